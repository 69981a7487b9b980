{{/*
The scrape endpoints of a ServiceMonitor or a PodMonitor: /metrics, and each probe
target when probe.scrape is on. The argument is (dict "root" $ "monitor" <its values>).
*/}}
{{- define "mig-exporter.endpoints" -}}
{{- $root := .root -}}
{{- $monitor := .monitor -}}
- port: metrics
  path: /metrics
  {{- include "mig-exporter.endpointCommon" (dict "root" $root "monitor" $monitor "interval" $monitor.interval) | nindent 2 }}
{{- if $root.Values.probe.scrape }}
{{- range $name, $_ := $root.Values.probe.targets }}
- port: metrics
  path: /probe
  params:
    target: [{{ $name | quote }}]
  {{- include "mig-exporter.endpointCommon" (dict "root" $root "monitor" $monitor "interval" (default $monitor.interval $root.Values.probe.interval)) | nindent 2 }}
    # A job of their own keeps a probe's device series apart from /metrics' ones:
    # the shipped rules count only (job, instance) pairs that export build_info.
    - targetLabel: job
      replacement: {{ printf "%s-probe" (include "mig-exporter.fullname" $root) }}
    - targetLabel: target
      replacement: {{ $name | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* What every endpoint carries; its relabelings list is left open for more. */}}
{{- define "mig-exporter.endpointCommon" -}}
{{- $root := .root -}}
{{- $monitor := .monitor -}}
{{- with .interval }}
interval: {{ . }}
{{- end }}
# The exporter answers within the scrape timeout less its offset.
scrapeTimeout: {{ $monitor.scrapeTimeout }}
{{- if $root.Values.tls.enabled }}
scheme: https
{{- with $monitor.tlsConfig }}
tlsConfig:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- with $monitor.basicAuth }}
basicAuth:
  {{- toYaml . | nindent 2 }}
{{- end }}
# The exporter's own namespace, pod and container labels name the workload that holds
# the memory; the Operator's target labels of the same names would rename them to
# exported_* unless the exporter's labels are honoured.
honorLabels: {{ $monitor.honorLabels }}
{{- with $monitor.metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
# node, and instance too: the node's name, which outlives the pod's address and is what the
# dashboards' Node variable lists (instance), as kube-prometheus-stack does for node-exporter.
relabelings:
  - sourceLabels: [__meta_kubernetes_pod_node_name]
    targetLabel: node
  - sourceLabels: [__meta_kubernetes_pod_node_name]
    targetLabel: instance
  {{- with $monitor.relabelings }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
