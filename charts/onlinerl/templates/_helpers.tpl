{{/* Names and labels shared by every template. */}}

{{- define "onlinerl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "onlinerl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "onlinerl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "onlinerl.labels" -}}
helm.sh/chart: {{ include "onlinerl.chart" . }}
app.kubernetes.io/name: {{ include "onlinerl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: onlinerl
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "operator"). */}}
{{- define "onlinerl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "onlinerl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "onlinerl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "onlinerl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "onlinerl.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{/*
"true" when a monitoring.coreos.com object should be rendered: mode on, or mode auto and the API is served.
Call with (dict "ctx" $ "mode" .Values.monitoring.prometheusRule).
*/}}
{{- define "onlinerl.monitoringEnabled" -}}
{{- if or (eq .mode "on") (and (eq .mode "auto") (.ctx.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end -}}

{{- define "onlinerl.redisFullname" -}}
{{- printf "%s-redis" (include "onlinerl.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "onlinerl.redisSecretName" -}}
{{- default (include "onlinerl.redisFullname" .) .Values.redis.auth.existingSecret -}}
{{- end -}}
