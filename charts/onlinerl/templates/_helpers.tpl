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

{{/*
Redis maxmemory: redis.maxmemory when set, else 75 % of the container's memory limit (else request) in bytes, which
leaves room for the AOF rewrite's fork. Policy is noeviction: at the limit writes fail, samples are never evicted.
*/}}
{{- define "onlinerl.redisMaxmemory" -}}
{{- $r := .Values.redis -}}
{{- if $r.maxmemory -}}
{{- $r.maxmemory -}}
{{- else -}}
{{- $res := $r.resources | default dict -}}
{{- $mem := toString (or (($res.limits | default dict).memory) (($res.requests | default dict).memory) "") -}}
{{- if $mem -}}
{{- $num := regexFind "^[0-9]+" $mem -}}
{{- $unit := trimPrefix $num $mem -}}
{{- $factors := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if or (not $num) (not (hasKey $factors $unit)) -}}
{{- fail (printf "redis.resources memory %q: use an integer with Ki/Mi/Gi/Ti/k/M/G/T, or set redis.maxmemory" $mem) -}}
{{- end -}}
{{- div (mul (int64 $num) (index $factors $unit) 3) 4 -}}
{{- end -}}
{{- end -}}
{{- end -}}
