{{/*
Set the chart's `jobDefaults` as the defaults of the OnlineRLJob CRD schema, so the API server fills them into every
job that leaves the field out (structural defaulting: every object in the schema defaults to {}, so a nested default
applies even when its section is absent). Walks the values and the schema together; a key that is not a spec field
fails the render naming its path. Called with (dict "schema" <spec schema node> "values" <map> "path" "jobDefaults").
*/}}
{{- define "onlinerl.setJobDefaults" -}}
{{- $schema := .schema -}}
{{- $path := .path -}}
{{- range $key, $value := .values -}}
{{- $prop := index (default dict $schema.properties) $key -}}
{{- if not $prop -}}
{{- fail (printf "%s.%s: not a field of the OnlineRLJob spec (see docs/architecture.md and crds/onlinerljob.yaml)" $path $key) -}}
{{- end -}}
{{- if and (kindIs "map" $value) $prop.properties -}}
{{- include "onlinerl.setJobDefaults" (dict "schema" $prop "values" $value "path" (printf "%s.%s" $path $key)) -}}
{{- else -}}
{{- $_ := set $prop "default" $value -}}
{{- end -}}
{{- end -}}
{{- end -}}
