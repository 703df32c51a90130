{{/*
Rules in the namespaces that hold OnlineRLJobs. Keep in sync with operator/rbac.yaml (tests/chart compares them).
No wildcard verbs or resources; secrets are read-only (auth keys and the Redis URL are user-provided).
*/}}
{{- define "onlinerl.jobRules" -}}
- apiGroups: [onlinerl.dev]
  resources: [onlinerljobs]
  verbs: [get, list, watch, patch, update]
- apiGroups: [onlinerl.dev]
  resources: [onlinerljobs/status]
  verbs: [get, patch, update]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: [onlinerl.dev]
  resources: [onlinerljobs/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [configmaps, services, persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, podmonitors]
  verbs: [get, list, watch, create, patch, update, delete]
# Kubernetes Events for decisions and errors (kopf posts through core/v1).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
