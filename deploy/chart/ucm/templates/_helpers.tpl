{{/* Release-scoped name prefix: "ucm" for a release named ucm, else "<release>-ucm". */}}
{{- define "ucm.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ucm.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of one component: manager, router, snapshot-agent. */}}
{{- define "ucm.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ucm.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "ucm.managerServiceAccount" -}}
{{- printf "%s-controller-manager" (include "ucm.fullname" .) -}}
{{- end -}}

{{- define "ucm.grpcEndpoint" -}}
{{- .Values.exporter.grpc.endpoint | default (printf "%s-grpc.%s.svc:%v" (include "ucm.fullname" .) .Release.Namespace .Values.exporter.grpc.port) -}}
{{- end -}}

{{- define "ucm.routerEndpoint" -}}
{{- .Values.exporter.router.endpoint | default (printf "%s-router.%s.svc:%v" (include "ucm.fullname" .) .Release.Namespace .Values.exporter.router.port) -}}
{{- end -}}

{{/* The container securityContext of Pod Security "restricted". */}}
{{- define "ucm.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "ucm.restrictedPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "ucm.anyFeature" -}}
{{- if or .Values.exporter.enabled .Values.snapshot.enabled .Values.vmexport.enabled -}}true{{- end -}}
{{- end -}}
