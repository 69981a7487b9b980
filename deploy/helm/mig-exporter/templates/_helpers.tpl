{{/* The chart's name, or nameOverride. */}}
{{- define "mig-exporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name: the release's, with the chart's name added unless it already holds it. */}}
{{- define "mig-exporter.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* What selects the pods: the same two labels deploy/k8s uses. */}}
{{- define "mig-exporter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mig-exporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Every object's labels: the selector's, deploy/k8s's part-of, and Helm's own. */}}
{{- define "mig-exporter.labels" -}}
{{ include "mig-exporter.selectorLabels" . }}
app.kubernetes.io/part-of: mig-exporter
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mig-exporter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mig-exporter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The config file's ConfigMap: the user's, or the chart's. */}}
{{- define "mig-exporter.configMapName" -}}
{{- default (include "mig-exporter.fullname" .) .Values.config.existingConfigMap }}
{{- end }}

{{/* The TLS Secret: the user's, or the chart's from tls.cert and tls.key. */}}
{{- define "mig-exporter.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "mig-exporter.fullname" .)) .Values.tls.existingSecret }}
{{- end }}

{{/* Whether the server reads a web config: TLS, basic auth, or the user's own. */}}
{{- define "mig-exporter.webConfig" -}}
{{- if or .Values.tls.enabled .Values.basicAuth.users .Values.webConfig.existingSecret }}true{{ end }}
{{- end }}

{{/* Basic auth may be asked for: the kubelet's probes cannot answer it. */}}
{{- define "mig-exporter.basicAuth" -}}
{{- if or .Values.basicAuth.users .Values.webConfig.existingSecret }}true{{ end }}
{{- end }}

{{- define "mig-exporter.webConfigSecretName" -}}
{{- default (printf "%s-web-config" (include "mig-exporter.fullname" .)) .Values.webConfig.existingSecret }}
{{- end }}

{{/*
How the kubelet checks a pod: a GET of the path (over HTTPS with TLS on), or, with basic auth,
only that the port is open, since the kubelet cannot log in. The argument is (list $ path).
*/}}
{{- define "mig-exporter.probeHandler" -}}
{{- $root := index . 0 -}}
{{- if include "mig-exporter.basicAuth" $root -}}
tcpSocket:
  port: metrics
{{- else -}}
httpGet:
  path: {{ index . 1 }}
  port: metrics
  {{- if $root.Values.tls.enabled }}
  scheme: HTTPS
  {{- end }}
{{- end }}
{{- end }}

{{- define "mig-exporter.scheme" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end }}
{{- end }}

{{/* The exporter's log level words: the chart says "warn", as most charts do. */}}
{{- define "mig-exporter.logLevel" -}}
{{- if eq .Values.logLevel "warn" }}warning{{ else }}{{ .Values.logLevel }}{{ end }}
{{- end }}

{{/* Milliseconds in a Prometheus duration (1m30s, 500ms), to compare two of them. */}}
{{- define "mig-exporter.ms" -}}
{{- $units := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 "d" 86400000 "w" 604800000 "y" 31536000000 -}}
{{- $total := 0 -}}
{{- range regexFindAll "[0-9]+(ms|s|m|h|d|w|y)" . -1 -}}
{{- $total = add $total (mul (regexFind "^[0-9]+" . | atoi) (get $units (regexReplaceAll "^[0-9]+" . ""))) -}}
{{- end -}}
{{- $total -}}
{{- end }}

{{/*
A scrape timeout longer than its interval makes the Prometheus Operator drop the whole
monitor, with no more than an event to say so. The argument is
(list monitor-name interval-value-name interval timeout).
*/}}
{{- define "mig-exporter.validateTimeout" -}}
{{- $name := index . 0 }}{{ $intervalName := index . 1 }}{{ $interval := index . 2 }}{{ $timeout := index . 3 }}
{{- if gt (include "mig-exporter.ms" $timeout | atoi) (include "mig-exporter.ms" $interval | atoi) }}
{{- fail (printf "%s.scrapeTimeout (%s) is longer than %s (%s): the Prometheus Operator would drop the whole monitor; make the timeout at most the interval" $name $timeout $intervalName $interval) }}
{{- end }}
{{- end }}

{{/*
Refusals the schema cannot word well: checked once, by the DaemonSet's template.
*/}}
{{- define "mig-exporter.validate" -}}
{{- with .Values.updateStrategy.rollingUpdate }}
{{- if and (eq $.Values.updateStrategy.type "RollingUpdate") .maxSurge (ne (toString .maxSurge) "0") .maxUnavailable (ne (toString .maxUnavailable) "0") }}
{{- fail "updateStrategy.rollingUpdate: Kubernetes refuses maxSurge beside a maxUnavailable other than 0 (the default is 1); set updateStrategy.rollingUpdate.maxUnavailable=0 with maxSurge" }}
{{- end }}
{{- end }}
{{- range $name := list "serviceMonitor" "podMonitor" }}
{{- $monitor := index $.Values $name }}
{{- if $monitor.enabled }}
{{- /* An empty interval is the Prometheus' own, which the chart cannot see. */}}
{{- if $monitor.interval }}
{{- include "mig-exporter.validateTimeout" (list $name (printf "%s.interval" $name) $monitor.interval $monitor.scrapeTimeout) }}
{{- end }}
{{- if and $.Values.probe.scrape $.Values.probe.interval }}
{{- include "mig-exporter.validateTimeout" (list $name "probe.interval" $.Values.probe.interval $monitor.scrapeTimeout) }}
{{- end }}
{{- if and $.Values.basicAuth.users (not $monitor.basicAuth) }}
{{- fail (printf "basicAuth.users is set but %s.basicAuth is empty: Prometheus would get 401 on every scrape; set %s.basicAuth.username and .password (Secret key references) to one of the users" $name $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled .Values.podMonitor.enabled }}
{{- fail "serviceMonitor.enabled and podMonitor.enabled are both true: every pod would be scraped twice; set one of them to false" }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not .Values.service.enabled) }}
{{- fail "serviceMonitor.enabled needs service.enabled: a ServiceMonitor finds the pods through the Service; set service.enabled=true, or use podMonitor.enabled instead" }}
{{- end }}
{{- if and .Values.probe.scrape (not (or .Values.serviceMonitor.enabled .Values.podMonitor.enabled)) }}
{{- fail "probe.scrape needs serviceMonitor.enabled or podMonitor.enabled: the probe targets are scraped through one of them" }}
{{- end }}
{{- $parts := splitList "/" .Values.image.repository }}
{{- $registry := include "mig-exporter.registry" . }}
{{- if and $registry (gt (len $parts) 1) (or (contains "." (first $parts)) (contains ":" (first $parts)) (eq (first $parts) "localhost")) }}
{{- fail (printf "image.repository %s starts with a registry (%s), and image.registry (or global.imageRegistry) %s would come before it: set image.registry=%s and image.repository=%s, or image.registry=\"\"" .Values.image.repository (first $parts) $registry (first $parts) (rest $parts | join "/")) }}
{{- end }}
{{- if include "mig-exporter.setsMigMonitor" .Values.env }}
{{- fail "env sets NVIDIA_MIG_MONITOR_DEVICES: set migMonitor.enabled=true instead, which also adds the SYS_ADMIN capability NVIDIA's runtime hook asks of a container that sets it" }}
{{- end }}
{{- $context := include "mig-exporter.securityContext" . | fromYaml }}
{{- if and $context.privileged (not $context.allowPrivilegeEscalation) }}
{{- fail "securityContext.privileged needs securityContext.allowPrivilegeEscalation=true: Kubernetes refuses a privileged container that may not escalate" }}
{{- end }}
{{- if and .Values.migMonitor.enabled (not (include "mig-exporter.mayMonitorMig" $context)) }}
{{- fail "migMonitor.enabled needs SYS_ADMIN in securityContext.capabilities.add (or a privileged container), which securityContext replaced: NVIDIA's runtime hook refuses NVIDIA_MIG_MONITOR_DEVICES without it" }}
{{- end }}
{{- range .Values.extraInitContainers }}
{{- if and (include "mig-exporter.setsMigMonitor" .env) (not (include "mig-exporter.mayMonitorMig" (.securityContext | default dict))) }}
{{- fail (printf "extraInitContainers: %s sets NVIDIA_MIG_MONITOR_DEVICES without SYS_ADMIN in its securityContext.capabilities.add: NVIDIA's runtime hook would refuse the pod" .name) }}
{{- end }}
{{- end }}
{{- if and .Values.probe.scrape .Values.config.existingConfigMap }}
{{- fail "probe.scrape scrapes probe.targets, which config.existingConfigMap replaces: name the targets in probe.targets, or scrape them with a job of your own (docs/probe.md)" }}
{{- end }}
{{- end }}

{{/* Where the objects go: namespaceOverride (an umbrella chart's), else the release's. */}}
{{- define "mig-exporter.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The image: [registry/]repository, then @digest when one is given (it pins the image, so the
tag is left out), else :tag (the chart's appVersion by default). global.imageRegistry wins
over image.registry, as in prometheus-node-exporter's chart.
*/}}
{{- define "mig-exporter.image" -}}
{{- $registry := include "mig-exporter.registry" . -}}
{{- $name := ternary (printf "%s/%s" (trimSuffix "/" $registry) .Values.image.repository) .Values.image.repository (ne $registry "") -}}
{{- if .Values.image.digest -}}
{{ $name }}@{{ .Values.image.digest }}
{{- else -}}
{{ $name }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* The image's registry: global.imageRegistry, else image.registry; empty for none. */}}
{{- define "mig-exporter.registry" -}}
{{- default .Values.image.registry ((.Values.global).imageRegistry) -}}
{{- end }}

{{/* Pull secrets: global.imagePullSecrets (names or {name: ...}), then imagePullSecrets. */}}
{{- define "mig-exporter.imagePullSecrets" -}}
{{- $secrets := list -}}
{{- range concat (((.Values.global).imagePullSecrets) | default list) .Values.imagePullSecrets -}}
{{- if kindIs "string" . -}}
{{- $secrets = append $secrets (dict "name" .) -}}
{{- else -}}
{{- $secrets = append $secrets . -}}
{{- end -}}
{{- end -}}
{{- with $secrets | uniq -}}
{{ toYaml . }}
{{- end -}}
{{- end }}

{{/*
The pod's securityContext: uid 0 by default, since the kubelet's pod-resources socket is root's
(mode 0755) and connect(2) needs write permission on it; nobody with nonRoot, which does
without device allocations (docs/kubernetes.md). podSecurityContext is merged over it.
*/}}
{{- define "mig-exporter.podSecurityContext" -}}
{{- $uid := ternary 65534 0 .Values.nonRoot -}}
{{- $context := dict "runAsNonRoot" .Values.nonRoot "runAsUser" $uid "runAsGroup" $uid "seccompProfile" (dict "type" "RuntimeDefault") -}}
{{- include "mig-exporter.merged" (list $context .Values.podSecurityContext) -}}
{{- end }}

{{/*
The container's securityContext: no privilege escalation, a read-only root, every capability
dropped; with migMonitor, SYS_ADMIN added, without which NVIDIA's runtime hook refuses
NVIDIA_MIG_MONITOR_DEVICES. securityContext is merged over it.
*/}}
{{- define "mig-exporter.securityContext" -}}
{{- $capabilities := dict "drop" (list "ALL") -}}
{{- if .Values.migMonitor.enabled }}{{ $_ := set $capabilities "add" (list "SYS_ADMIN") }}{{ end -}}
{{- $context := dict "allowPrivilegeEscalation" false "readOnlyRootFilesystem" true "capabilities" $capabilities -}}
{{- /* The one standard way a container may open /dev/kmsg (c 1:11): runtimes leave it out of a
container's devices, and no pod field grants one device (docs/xids.md). */ -}}
{{- if and .Values.xidKmsg.enabled .Values.xidKmsg.privileged }}
{{- $_ := set $context "privileged" true }}{{ $_ := set $context "allowPrivilegeEscalation" true }}
{{- end -}}
{{- include "mig-exporter.merged" (list $context .Values.securityContext) -}}
{{- end }}

{{/* Whether a probe target runs a command under /run/nvidia (the GPU Operator's driver root). */}}
{{- define "mig-exporter.mountsRunNvidia" -}}
{{- if not .Values.config.existingConfigMap }}
{{- range $_, $target := .Values.probe.targets }}
{{- if and $target (hasPrefix "/run/nvidia/" (first $target.command)) }}true{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
(list defaults override) as YAML: the override's keys over the defaults', maps merged one level
down (capabilities, seccompProfile). Not sprig's merge: it lets no false or 0 of the user's
replace a default (readOnlyRootFilesystem: false would be lost).
*/}}
{{- define "mig-exporter.merged" -}}
{{- $out := deepCopy (index . 0) -}}
{{- range $key, $value := index . 1 -}}
{{- if and (kindIs "map" $value) (kindIs "map" (get $out $key)) -}}
{{- $inner := get $out $key -}}
{{- range $innerKey, $innerValue := $value }}{{ $_ := set $inner $innerKey $innerValue }}{{ end -}}
{{- else -}}
{{- $_ := set $out $key $value -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end }}

{{/* Whether a container's env list sets NVIDIA_MIG_MONITOR_DEVICES. */}}
{{- define "mig-exporter.setsMigMonitor" -}}
{{- range . }}{{ if eq (toString .name) "NVIDIA_MIG_MONITOR_DEVICES" }}true{{ end }}{{ end -}}
{{- end }}

{{/*
Whether a container securityContext lets NVIDIA's runtime hook accept NVIDIA_MIG_MONITOR_DEVICES:
privileged, or CAP_SYS_ADMIN in its capabilities (the hook reads the bounding set).
*/}}
{{- define "mig-exporter.mayMonitorMig" -}}
{{- if .privileged }}true{{ end }}
{{- range ((.capabilities).add) }}
{{- if has (upper (toString .) | trimPrefix "CAP_") (list "SYS_ADMIN" "ALL") }}true{{ end }}
{{- end }}
{{- end }}

{{/*
The pods' affinity: the user's, or a node affinity from gpuNodes: one term per anyOf
requirement, each with every allOf requirement (terms are ORed, a term's expressions ANDed).
*/}}
{{- define "mig-exporter.affinity" -}}
{{- if .Values.affinity -}}
{{ toYaml .Values.affinity }}
{{- else if .Values.gpuNodes.anyOf -}}
{{- $terms := list -}}
{{- range .Values.gpuNodes.anyOf -}}
{{- $terms = append $terms (dict "matchExpressions" (prepend ($.Values.gpuNodes.allOf | default list) .)) -}}
{{- end -}}
{{ toYaml (dict "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms))) }}
{{- end -}}
{{- end }}
