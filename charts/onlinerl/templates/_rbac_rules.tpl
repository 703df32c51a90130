{{/*
Rules in the namespaces that hold OnlineRLJobs. Keep in sync with operator/rbac.yaml (tests/chart compares them).
No wildcard verbs or resources; secrets are read and created only (the generated Redis password of a job), never
patched, listed or deleted.
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
# Children are read and written by name only: no list/watch on them; Secrets are only read or created by name.
- apiGroups: [""]
  resources: [configmaps, services, persistentvolumeclaims]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses, networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, podmonitors]
  verbs: [get, create, patch, delete]
# Scaling (autoscaling/v2, policy/v1, KEDA where served) and the multi-node trainer's JobSet (where served).
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete]
- apiGroups: [jobset.x-k8s.io]
  resources: [jobsets]
  verbs: [get, create, patch, delete]
# Kubernetes Events for decisions and errors (kopf posts through core/v1).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
