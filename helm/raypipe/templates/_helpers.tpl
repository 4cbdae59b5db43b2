{{/* Names, labels and the shared pieces of the RayJob and RayCluster specs. */}}

{{- define "raypipe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources. 47 characters at most: KubeRay appends
6 characters to a RayJob's name to name its RayCluster, and rejects RayCluster
names longer than 53 (it must also be a DNS-1035 label).
*/}}
{{- define "raypipe.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "raypipe.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that identify the release's pods (the PodMonitor selects on them). */}}
{{- define "raypipe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raypipe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "raypipe.labels" -}}
helm.sh/chart: {{ include "raypipe.chart" . }}
{{ include "raypipe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "raypipe.image" -}}
{{- printf "%s:%v" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Named container port of the raypipe exporter (at most 15 characters). */}}
{{- define "raypipe.metricsPortName" -}}raypipe-metrics{{- end }}

{{/*
training.replicas as JSON {"min": m, "max": M, "elastic": bool}: an int N is a fixed run (N, N), a
map {min, max} an elastic one. Fails when min is above max.
*/}}
{{- define "raypipe.replicaRange" -}}
{{- $replicas := .Values.training.replicas | default 1 }}
{{- if kindIs "map" $replicas }}
{{- $min := int $replicas.min }}
{{- $max := int $replicas.max }}
{{- if gt $min $max }}
{{- fail (printf "training.replicas: min=%d is above max=%d; an elastic run moves between 1 <= min <= max replicas" $min $max) }}
{{- end }}
{{- toJson (dict "min" $min "max" $max "elastic" true) }}
{{- else }}
{{- toJson (dict "min" (int $replicas) "max" (int $replicas) "elastic" false) }}
{{- end }}
{{- end }}

{{/* The --replicas flag of training.replicas: N, or MIN:MAX for an elastic run. */}}
{{- define "raypipe.replicasFlag" -}}
{{- $range := include "raypipe.replicaRange" . | fromJson }}
{{- if $range.elastic }}{{ printf "%d:%d" (int $range.min) (int $range.max) }}{{ else }}{{ int $range.max }}{{ end }}
{{- end }}

{{/*
Stage workers one worker pod holds: its GPUs with the 7b preset (a stage per GPU), its whole CPUs
(limits, else requests) with tiny (a stage per CPU).
*/}}
{{- define "raypipe.stagesPerPod" -}}
{{- $resources := .Values.gpuWorkers.resources }}
{{- $limits := $resources.limits | default dict }}
{{- if eq (toString .Values.training.preset) "7b" }}
{{- int (index $limits "nvidia.com/gpu" | default 0) }}
{{- else }}
{{- $cpu := toString (index $limits "cpu" | default (index ($resources.requests | default dict) "cpu") | default "0") }}
{{- if hasSuffix "m" $cpu }}{{ div (int (trimSuffix "m" $cpu)) 1000 }}{{ else }}{{ int (floor $cpu) }}{{ end }}
{{- end }}
{{- end }}

{{/*
The GPU worker group's pods as JSON {"min", "max", "start"}. Unset gpuWorkers.minReplicas and
maxReplicas follow training.replicas: the pods holding training.stages x min (max) replicas'
stages (training.tensorParallel workers each) and training.spareWorkers,
ceil((stages x tensorParallel x replicas + spares) / workers per pod); unset
gpuWorkers.replicas starts at the pods of max replicas, within [min, max].
*/}}
{{- define "raypipe.workerPods" -}}
{{- $w := .Values.gpuWorkers }}
{{- $range := include "raypipe.replicaRange" . | fromJson }}
{{- $perPod := int (include "raypipe.stagesPerPod" .) }}
{{- $stages := mul (int .Values.training.stages) (int (.Values.training.tensorParallel | default 1)) }}
{{- $spares := int (.Values.training.spareWorkers | default 0) }}
{{- $needed := dict "min" 0 "max" 0 }}
{{- if gt $perPod 0 }}
{{- range $bound := list "min" "max" }}
{{- $_ := set $needed $bound (div (add (mul $stages (int (index $range $bound))) $spares (sub $perPod 1)) $perPod) }}
{{- end }}
{{- else if or (kindIs "invalid" $w.minReplicas) (kindIs "invalid" $w.maxReplicas) }}
{{- fail (printf "gpuWorkers: a worker pod holds no pipeline stage (training.preset=%s: a stage per %s, none in gpuWorkers.resources), so its minReplicas and maxReplicas cannot follow training.replicas; set them" (toString .Values.training.preset) (ternary "GPU" "whole CPU" (eq (toString .Values.training.preset) "7b"))) }}
{{- end }}
{{- $min := ternary $needed.min (int $w.minReplicas) (kindIs "invalid" $w.minReplicas) }}
{{- $max := ternary $needed.max (int $w.maxReplicas) (kindIs "invalid" $w.maxReplicas) }}
{{- $start := ternary (max $min (min $max $needed.max)) (int $w.replicas) (kindIs "invalid" $w.replicas) }}
{{- toJson (dict "min" $min "max" $max "start" $start) }}
{{- end }}

{{/*
Checks across values that values.schema.json cannot express; each failure names
the values involved and what is allowed.
*/}}
{{- define "raypipe.validate" -}}
{{- $w := .Values.gpuWorkers }}
{{- if not (or .Values.job.enabled .Values.rayCluster.enabled) }}
{{- fail "nothing to deploy: set job.enabled=true (a RayJob) and/or rayCluster.enabled=true (a standalone RayCluster)" }}
{{- end }}
{{- $gpus := int (index ($w.resources.limits | default dict) "nvidia.com/gpu" | default 0) }}
{{- if and (eq (toString .Values.training.preset) "7b") .Values.job.enabled (eq $gpus 0) }}
{{- fail "training.preset=7b runs one pipeline stage per GPU, but gpuWorkers.resources.limits has no nvidia.com/gpu; set it (e.g. 8) or use training.preset=tiny" }}
{{- end }}
{{- $pods := include "raypipe.workerPods" . | fromJson }}
{{- $spareGroup := int (.Values.training.tensorParallel | default 1) }}
{{- if mod (int (.Values.training.spareWorkers | default 0)) $spareGroup }}
{{- fail (printf "training.spareWorkers=%d must be a multiple of training.tensorParallel=%d: a spare is a group of tensorParallel processes on one pod that takes a whole stage's place" (int .Values.training.spareWorkers) $spareGroup) }}
{{- end }}
{{- if and (eq (toString .Values.training.preset) "7b") .Values.job.enabled }}
{{- $range := include "raypipe.replicaRange" . | fromJson }}
{{- $tp := int (.Values.training.tensorParallel | default 1) }}
{{- if gt $tp $gpus }}
{{- fail (printf "training.tensorParallel=%d keeps a stage's workers on one pod, but a pod has %d GPUs (gpuWorkers.resources.limits[nvidia.com/gpu])" $tp $gpus) }}
{{- end }}
{{- $workers := mul (int .Values.training.stages) $tp (int $range.max) }}
{{- if gt $workers (mul $gpus (int $pods.max)) }}
{{- fail (printf "training.stages=%d%s x training.replicas%s=%d needs %d GPUs, but gpuWorkers.maxReplicas=%d pods x %d GPUs (gpuWorkers.resources.limits[nvidia.com/gpu]) = %d" (int .Values.training.stages) (ternary (printf " x training.tensorParallel=%d" $tp) "" (gt $tp 1)) (ternary ".max" "" $range.elastic) (int $range.max) $workers (int $pods.max) $gpus (mul $gpus (int $pods.max))) }}
{{- end }}
{{- end }}
{{- if or (gt (int $pods.min) (int $pods.start)) (gt (int $pods.start) (int $pods.max)) }}
{{- fail (printf "gpuWorkers: need minReplicas <= replicas <= maxReplicas, got minReplicas=%d replicas=%d maxReplicas=%d (unset ones follow training.stages x training.replicas)" (int $pods.min) (int $pods.start) (int $pods.max)) }}
{{- end }}
{{- if and .Values.job.enabled (gt (int .Values.job.backoffLimit) 0) }}
{{- if not .Values.training.resume }}
{{- fail (printf "job.backoffLimit=%d reruns a failed job, which must resume from its checkpoints: set training.resume=true, or job.backoffLimit=0" (int .Values.job.backoffLimit)) }}
{{- end }}
{{- $dir := toString .Values.training.checkpointDir }}
{{- if not (contains "://" $dir) }}
{{- $mounted := false }}
{{- range .Values.volumeMounts }}
{{- if or (eq $dir .mountPath) (hasPrefix (printf "%s/" (trimSuffix "/" .mountPath)) $dir) }}{{ $mounted = true }}{{ end }}
{{- end }}
{{- if not $mounted }}
{{- fail (printf "training.checkpointDir=%s is on the head pod's own disk, which a rerun (job.backoffLimit=%d, on a fresh cluster) does not see: use an s3:// or gs:// URI, or a path under one of volumeMounts (e.g. a PersistentVolumeClaim)" $dir (int .Values.job.backoffLimit)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.job.enabled .Values.rayCluster.enabled (eq .Values.job.submissionMode "SidecarMode") }}
{{- fail "job.submissionMode=SidecarMode cannot run on the standalone RayCluster (rayCluster.enabled=true): KubeRay supports it only for a RayJob's own cluster; use K8sJobMode or HTTPMode" }}
{{- end }}
{{- end }}

{{/* --balance, unless it is the default "parameters": a list of layers per stage as "3,3,2". */}}
{{- define "raypipe.balanceFlag" -}}
{{- $b := .Values.training.balance -}}
{{- if kindIs "slice" $b }} --balance {{ range $i, $size := $b }}{{ if $i }},{{ end }}{{ int $size }}{{ end }}
{{- else if and $b (ne (toString $b) "parameters") }} --balance {{ $b }}
{{- end }}
{{- end }}

{{/* The training command: the flags of jobs/train_7b.py. */}}
{{- define "raypipe.entrypoint" -}}
{{- $t := .Values.training -}}
python jobs/train_7b.py --preset {{ $t.preset }} --stages {{ int $t.stages }} --replicas {{ include "raypipe.replicasFlag" . }}{{ if $t.shardOptimizer }} --shard-optimizer{{ end }}{{ if and $t.schedule (ne $t.schedule "gpipe") }} --schedule {{ $t.schedule }}{{ end }}{{ if $t.virtualStages }} --virtual-stages {{ int $t.virtualStages }}{{ end }}{{ if gt (int ($t.tensorParallel | default 1)) 1 }} --tensor-parallel {{ int $t.tensorParallel }}{{ end }}{{ if eq (toString $t.sequenceParallel) "true" }} --sequence-parallel{{ else if eq (toString $t.sequenceParallel) "false" }} --no-sequence-parallel{{ end }}{{ include "raypipe.balanceFlag" . }} --max-failures {{ int $t.maxFailures }} --snapshot-every {{ int $t.snapshotEvery }}{{ if and $t.boundaryShapes (ne $t.boundaryShapes "learned") }} --boundary-shapes {{ $t.boundaryShapes }}{{ end }}{{ if $t.spareWorkers }} --spare-workers {{ int $t.spareWorkers }}{{ end }} --hang-timeout {{ $t.hangTimeoutSeconds }}{{ if and (not (kindIs "invalid" $t.slowFactor)) (ne (toString $t.slowFactor) "1.3") }} --slow-factor {{ $t.slowFactor }}{{ end }}{{ if and $t.slowSteps (ne (int $t.slowSteps) 10) }} --slow-steps {{ int $t.slowSteps }}{{ end }}{{ if and $t.onSlow (ne $t.onSlow "report") }} --on-slow {{ $t.onSlow }}{{ end }} --replace-timeout {{ $t.replaceTimeoutSeconds }} --micro-batches {{ int $t.microBatches }} --micro-batch-size {{ int $t.microBatchSize }} --seq-len {{ int $t.seqLen }} --steps {{ int $t.steps }} --data {{ $t.dataPath }}{{ if $t.pack }} --pack{{ end }} --checkpoint-dir {{ $t.checkpointDir }} --checkpoint-every {{ int $t.checkpointEvery }}
{{- if gt (int $t.keepLast) 0 }} --keep-last {{ int $t.keepLast }}{{ end }} {{ if $t.resume }}--resume{{ else }}--no-resume{{ end }} --metrics-port {{ int $t.metricsPort }}
{{- if $t.metricsHost }} --metrics-host {{ $t.metricsHost }}{{ end }}
{{- range $t.extraArgs }} {{ . }}{{ end }}
{{- end }}

{{/* `ray start` parameters as a JSON (flow YAML) map: KubeRay wants string values. */}}
{{- define "raypipe.rayStartParams" -}}
{{- $params := dict }}
{{- range $key, $value := . }}
{{- $_ := set $params $key (toString $value) }}
{{- end }}
{{- toJson $params }}
{{- end }}

{{/* Pod-level settings shared by every pod the chart defines. */}}
{{- define "raypipe.podCommon" -}}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Container settings shared by the Ray head and worker containers; the argument is
(dict "root" $ "env" list): ``env`` goes before the user's .Values.env, which can override it. */}}
{{- define "raypipe.containerCommon" -}}
{{- $root := .root }}
image: {{ include "raypipe.image" $root }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
securityContext:
  {{- toYaml $root.Values.containerSecurityContext | nindent 2 }}
{{- with concat .env $root.Values.env }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  # Ray's object store lives in /dev/shm; the container default (64 MiB) is far too small.
  - name: dshm
    mountPath: /dev/shm
  {{- with $root.Values.volumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* How fast the GCS declares a lost node dead (head.nodeHealthCheck): Ray's RAY_health_check_*
settings, read by the GCS on the head. */}}
{{- define "raypipe.nodeHealthCheckEnv" -}}
{{- $check := .Values.head.nodeHealthCheck }}
- name: RAY_health_check_period_ms
  value: {{ int $check.periodMs | quote }}
- name: RAY_health_check_timeout_ms
  value: {{ int $check.timeoutMs | quote }}
- name: RAY_health_check_failure_threshold
  value: {{ int $check.failureThreshold | quote }}
{{- end }}

{{/* How long a raylet waits for a worker it kills to exit before SIGKILL (workerKillGraceMs):
Ray's RAY_kill_worker_timeout_milliseconds, read by the raylet of every node. */}}
{{- define "raypipe.workerKillEnv" -}}
- name: RAY_kill_worker_timeout_milliseconds
  value: {{ int .Values.workerKillGraceMs | quote }}
{{- end }}

{{/* Volumes of a Ray pod; the argument is (dict "root" $ "shmSize" size). */}}
{{- define "raypipe.volumes" -}}
volumes:
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .shmSize }}
  {{- with .root.Values.volumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* Scheduling of a pod group; the argument is head or gpuWorkers values. */}}
{{- define "raypipe.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Metadata of a Ray pod; the argument is (dict "root" $ "component" name). */}}
{{- define "raypipe.podMetadata" -}}
labels:
  {{- include "raypipe.selectorLabels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The Ray cluster: used as the RayJob's rayClusterSpec and the RayCluster's spec. */}}
{{- define "raypipe.rayClusterSpec" -}}
{{- $w := .Values.gpuWorkers -}}
{{- $pods := include "raypipe.workerPods" . | fromJson -}}
rayVersion: {{ .Values.rayVersion | quote }}
enableInTreeAutoscaling: {{ .Values.autoscaling.enabled }}
{{- if .Values.autoscaling.enabled }}
autoscalerOptions:
  version: {{ .Values.autoscaling.version }}
  upscalingMode: {{ .Values.autoscaling.upscalingMode }}
  idleTimeoutSeconds: {{ int .Values.autoscaling.idleTimeoutSeconds }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  resources:
    {{- toYaml .Values.autoscaling.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
{{- end }}
headGroupSpec:
  rayStartParams: {{ include "raypipe.rayStartParams" .Values.head.rayStartParams }}
  template:
    metadata:
      {{- include "raypipe.podMetadata" (dict "root" . "component" "ray-head") | nindent 6 }}
    spec:
      {{- include "raypipe.podCommon" . | trim | nindent 6 }}
      {{- with include "raypipe.scheduling" .Values.head | trim }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: ray-head
          {{- include "raypipe.containerCommon" (dict "root" . "env" (concat (include "raypipe.nodeHealthCheckEnv" . | fromYamlArray) (include "raypipe.workerKillEnv" . | fromYamlArray))) | nindent 10 }}
          ports:
            - name: gcs-server
              containerPort: 6379
            - name: dashboard
              containerPort: 8265
            - name: client
              containerPort: 10001
            # Ray's own metrics (ray_*); KubeRay starts Ray with --metrics-export-port=8080.
            - name: metrics
              containerPort: 8080
            # raypipe's exporter: the driver runs on the head.
            - name: {{ include "raypipe.metricsPortName" . }}
              containerPort: {{ int .Values.training.metricsPort }}
          resources:
            {{- toYaml .Values.head.resources | nindent 12 }}
      {{- include "raypipe.volumes" (dict "root" . "shmSize" .Values.head.shmSize) | nindent 6 }}
workerGroupSpecs:
  - groupName: {{ $w.groupName }}
    replicas: {{ int $pods.start }}
    minReplicas: {{ int $pods.min }}
    maxReplicas: {{ int $pods.max }}
    rayStartParams: {{ include "raypipe.rayStartParams" $w.rayStartParams }}
    template:
      metadata:
        {{- include "raypipe.podMetadata" (dict "root" . "component" "ray-gpu-worker") | nindent 8 }}
      spec:
        {{- include "raypipe.podCommon" . | trim | nindent 8 }}
        {{- with include "raypipe.scheduling" $w | trim }}{{ . | nindent 8 }}{{ end }}
        containers:
          - name: ray-worker
            {{- include "raypipe.containerCommon" (dict "root" . "env" (include "raypipe.workerKillEnv" . | fromYamlArray)) | nindent 12 }}
            ports:
              - name: metrics
                containerPort: 8080
            resources:
              {{- toYaml $w.resources | nindent 14 }}
        {{- include "raypipe.volumes" (dict "root" . "shmSize" $w.shmSize) | nindent 8 }}
{{- end }}
