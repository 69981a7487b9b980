"""The ``mig-exporter`` command: ``serve``, ``read``, ``doctor``, ``check-config`` and ``check-web-config``.

Every option can also be set from the environment: ``--timeout`` from
``MIG_EXPORTER_TIMEOUT``, ``--web.listen-address`` from
``MIG_EXPORTER_WEB_LISTEN_ADDRESS``, and so on (``--help`` shows each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

import click
from click.core import ParameterSource

from mig_exporter import __version__, prometheus_api
from mig_exporter import fleet as fleet_view
from mig_exporter import status as status_view
from mig_exporter.config.checks import ConfigError
from mig_exporter.config.file import EMPTY, Config, load_config
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import CommandError
from mig_exporter.core.logs import FORMATS, setup_logging
from mig_exporter.core.malloc_tuning import limit_arenas
from mig_exporter.doctor import (
    DEFAULT_SLOW_THRESHOLD_S,
    PathReading,
    as_json,
    diagnose,
    render_text,
    shown_snapshot,
    timed_read,
)
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import EngineSettings
from mig_exporter.host.jobmap import SlurmJobMap
from mig_exporter.host.owners import OwnerReader
from mig_exporter.host.procfs import DEFAULT_ROOT as DEFAULT_PROC_ROOT
from mig_exporter.host.procfs import ProcError, ProcfsSource
from mig_exporter.kubernetes.podlogs import DEFAULT_LOG_DIR
from mig_exporter.kubernetes.podresources import DEFAULT_SOCKET, PodResourcesClient
from mig_exporter.kubernetes.pods import PodReader, in_a_pod
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.process_series import ALL_PROCESSES, ProcessSeries
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.capacity import HostView, host_view
from mig_exporter.model.snapshot import ACTIVITY_FIRST_SAMPLE, Snapshot
from mig_exporter.sources.auto import AutoSource
from mig_exporter.sources.base import Source
from mig_exporter.sources.command import kill_running, reaping
from mig_exporter.sources.demo import DEMO_BOOT_SECONDS, DemoProcs, DemoSource
from mig_exporter.sources.kmsg import DEFAULT_PATH as DEFAULT_KMSG
from mig_exporter.sources.kmsg import KmsgReader, kmsg_status
from mig_exporter.sources.nvidia_smi import DEFAULT_BINARY, DEFAULT_TIMEOUT_S, NvidiaSmiSource
from mig_exporter.sources.nvml import NvmlSource
from mig_exporter.sources.nvml_activity import DEFAULT_WINDOW_S, MIN_INTERVAL_S
from mig_exporter.sources.xid import XidListener
from mig_exporter.web.connections import Limits, raise_open_file_limit
from mig_exporter.web.probe import DEFAULT_MAX_CONCURRENT, Prober
from mig_exporter.web.server import DEFAULT_LISTEN_ADDRESS, ExporterServer, parse_listen_address
from mig_exporter.web.webconfig import WebSettings, load_web_config

ENV_PREFIX = "MIG_EXPORTER_"
log = logging.getLogger("mig_exporter")


def _env(name: str) -> str:
    return ENV_PREFIX + name


SOURCES = ("auto", "nvml", "nvidia-smi", "demo")


def _nvidia_smi_option() -> Callable[..., Any]:
    return click.option("--nvidia-smi", "nvidia_smi", default=DEFAULT_BINARY, show_default=True,
                        envvar=_env("NVIDIA_SMI"), show_envvar=True,
                        help="The nvidia-smi binary: a path, or a name looked up on PATH.")


def _timeout_option(help_text: str) -> Callable[..., Any]:
    return click.option("--timeout", type=click.FloatRange(min=0.1, max=600), default=DEFAULT_TIMEOUT_S,
                        show_default=True, envvar=_env("TIMEOUT"), show_envvar=True, help=help_text)


def _source_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--source", type=click.Choice(SOURCES), default="auto", show_default=True,
                     envvar=_env("SOURCE"), show_envvar=True,
                     help="Where to read: NVML (libnvidia-ml), nvidia-smi, or the bundled demo sample. "
                          "auto takes NVML where the library loads, else nvidia-smi (nvidia-smi when "
                          "--nvidia-smi is given)."),
        _nvidia_smi_option(),
        _timeout_option("Seconds a read may take; at the deadline the command's process group is killed."),
        click.option("--demo", is_flag=True, default=False, envvar=_env("DEMO"), show_envvar=True,
                     help="Same as --source demo: the bundled sample (an A100 in MIG mode and a whole A100, and "
                          "its host's processes) instead of a GPU and /proc."),
    ]
    return _with_options(options)(func)


def _with_options(options: list[Callable[..., Any]]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            func = option(func)
        return func
    return apply


def _engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--config.file", "config_file", type=click.Path(dir_okay=False), default=None,
                     envvar=_env("CONFIG_FILE"), show_envvar=True,
                     help="YAML config file: probe_targets: (the commands /probe may run, serve only; "
                          "docs/probe.md) and engines: (which processes are inference engines; docs/engines.md; "
                          "without it every preset is on). serve reloads it on SIGHUP and POST /-/reload."),
        click.option("--proc.root", "proc_root", metavar="DIR", default=DEFAULT_PROC_ROOT, show_default=True,
                     envvar=_env("PROC_ROOT"), show_envvar=True,
                     help="The /proc to read processes from, e.g. /host/proc in a container that mounts the host's."),
        click.option("--host.passwd", "host_passwd", metavar="PATH", type=click.Path(dir_okay=False), default=None,
                     envvar=_env("HOST_PASSWD"), show_envvar=True,
                     help="The host's passwd file (e.g. /host/etc/passwd), which names the user of each GPU process "
                          "(docs/hpc.md). Without it, or for a uid it lacks, the user is the uid."),
    ]
    return _with_options(options)(func)


def _kubernetes_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--kubernetes/--no-kubernetes", "kubernetes", default=True, show_default=True,
                     envvar=_env("KUBERNETES"), show_envvar=True,
                     help="Attribute GPU processes to their containers and pods, and devices to the pods they are "
                          "allocated to (docs/kubernetes.md). Off: no kubelet or log directory is read (the "
                          "cgroups still are, for Slurm jobs and systemd units)."),
        click.option("--kubelet.pod-resources-socket", "pod_resources_socket", metavar="PATH", default=DEFAULT_SOCKET,
                     show_default=True, envvar=_env("KUBELET_POD_RESOURCES_SOCKET"), show_envvar=True,
                     help="The kubelet's pod-resources socket, asked at each read which devices are allocated to "
                          "which pod (needs uid 0: the socket is root's). Empty: do not ask."),
        click.option("--kubelet.log-dir", "kubelet_log_dir", metavar="DIR", default=DEFAULT_LOG_DIR,
                     show_default=True, envvar=_env("KUBELET_LOG_DIR"), show_envvar=True,
                     help="Where the kubelet's pods/ and containers/ log directories are, whose names give each "
                          "container's pod, namespace and name (only the names are read). Empty: no names."),
    ]
    return _with_options(options)(func)


def _slurm_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--slurm.job-map-dir", "slurm_job_map_dir", metavar="DIR", default=None,
                     envvar=_env("SLURM_JOB_MAP_DIR"), show_envvar=True,
                     help="The directory Slurm prolog/epilog scripts keep for dcgm-exporter's --hpc-job-mapping-dir "
                          "(often /run/dcgm-job-map): a file per GPU index or GPU-/MIG- UUID, holding job ids. Read "
                          "at each scrape into mig_exporter_device_allocation_info{slurm_job} (docs/metrics.md). "
                          "Unset: not read."),
    ]
    return _with_options(options)(func)


class _ProcessSeriesType(click.ParamType):  # type: ignore[type-arg]
    name = "all|top=N|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> ProcessSeries:
        if isinstance(value, ProcessSeries):
            return value
        try:
            return ProcessSeries.parse(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _process_series_option() -> Callable[..., Any]:
    return click.option(
        "--collector.processes", "process_series", type=_ProcessSeriesType(), default="all", show_default=True,
        envvar=_env("COLLECTOR_PROCESSES"), show_envvar=True,
        help="Which processes get series of their own (process_memory_used_bytes, process_info, and the engine "
             "families): all; top=N, the N holding the most memory on each device and one pid=\"other\" series for "
             "the rest; or none (the engines' as pid=\"other\" sums). An engine on no GPU keeps its own series "
             "(EngineHoldsNoGPUMemory). Device, pod, Slurm job, systemd unit and engine memory sums count every "
             "process whatever this says (docs/scale.md).")


def _activity_window_option() -> Callable[..., Any]:
    return click.option(
        "--collector.activity.window", "activity_window", type=click.FloatRange(min=MIN_INTERVAL_S, max=3600),
        default=DEFAULT_WINDOW_S, show_default=True, metavar="SECONDS", envvar=_env("COLLECTOR_ACTIVITY_WINDOW"),
        show_envvar=True,
        help="The least time each GPM activity value (NVML, Hopper and later) averages over, and the time each "
             "process's activity on a whole card averages over (NVML): every scraper gets about this window, "
             "whatever its phase, from samples kept about 2.5 windows (a scraper slower than that sees "
             "first_sample). read, which reads once, takes a first GPM sample and waits a second: its GPM window "
             "is about 1 s. docs/activity.md.")


def _make_pod_reader(kubernetes: bool, proc_root: str, socket: str, log_dir: str, demo: bool) -> PodReader | None:
    """Where pods are read from, or None when switched off (and in the demo,
    whose sample host is not a Kubernetes node)."""
    if not kubernetes or demo:
        return None
    reader = PodReader(proc_root, PodResourcesClient(socket) if socket else None, log_dir or None, in_pod=in_a_pod())
    log.info("reading %s at each scrape", reader.describe())
    return reader


def _make_job_map(directory: str | None) -> SlurmJobMap | None:
    if not directory:
        return None
    job_map = SlurmJobMap(directory)
    log.info("reading %s at each scrape", job_map.describe())
    return job_map


def _make_owner_reader(proc_root: str, passwd: str | None, demo: bool) -> OwnerReader | None:
    """Where Slurm jobs, systemd units and users are read from: on any host,
    Kubernetes or not (not in the demo, whose processes have no cgroups)."""
    if demo:
        return None
    reader = OwnerReader(proc_root, passwd)
    log.info("reading %s at each scrape", reader.describe())
    return reader


def _make_scraper(source: Source, engines: EngineReader, *, proc_root: str, host_passwd: str | None,
                  kubernetes: bool, pod_resources_socket: str, kubelet_log_dir: str, slurm_job_map_dir: str | None,
                  demo: bool, process_series: ProcessSeries = ALL_PROCESSES) -> Scraper:
    """The scrape of ``source`` with the readers the options ask for (serve and read alike)."""
    pods = _make_pod_reader(kubernetes, proc_root, pod_resources_socket, kubelet_log_dir, demo)
    owners = _make_owner_reader(proc_root, host_passwd, demo)
    return Scraper(source, engines, pods=pods, owners=owners, job_map=_make_job_map(slurm_job_map_dir),
                   process_series=process_series)


def _xid_kmsg_option() -> Callable[..., Any]:
    return click.option(
        "--collector.xid.kmsg", "xid_kmsg", default=DEFAULT_KMSG, show_default=True, metavar="PATH",
        envvar=_env("COLLECTOR_XID_KMSG"), show_envvar=True,
        help="The kernel's log, for the driver's XID lines: read from its oldest record, then at each scrape its "
             "new ones (XIDs since boot, with their MIG instance and pid; CAP_SYSLOG where "
             "kernel.dmesg_restrict=1); empty to turn it off. docs/xids.md.")


def _kmsg_path(path: str, demo: bool) -> str:
    """The kernel log read: ``--collector.xid.kmsg``'s (empty: none), or the demo's bundled sample."""
    if demo:
        return str(resources.files("mig_exporter").joinpath("samples").joinpath("demo-kmsg.txt"))
    return path


def _make_kmsg_reader(path: str, demo: bool) -> KmsgReader | None:
    """The kernel log's XID reader (``None``: turned off); the demo's is its bundled sample, on
    the demo machine's clock."""
    path = _kmsg_path(path, demo)
    if not path:
        return None
    reader = KmsgReader(path, boot=lambda: DEMO_BOOT_SECONDS) if demo else KmsgReader(path)
    log.info("reading %s at each scrape", reader.describe())
    return reader


def _make_engine_reader(settings: EngineSettings, proc_root: str, demo: bool) -> EngineReader:
    """Which processes are engines, read from /proc or the demo's processes."""
    reader = EngineReader(settings, DemoProcs() if demo else ProcfsSource(proc_root))
    log.info("reading %s at each scrape", reader.describe())
    return reader


def _log_options(default_level: str) -> list[Callable[..., Any]]:
    return [
        click.option("--log.level", "--log-level", "log_level",
                     type=click.Choice(["debug", "info", "warning", "error"]), default=default_level,
                     show_default=True, envvar=_env("LOG_LEVEL"), show_envvar=True, help="Log verbosity."),
        click.option("--log.format", "log_format", type=click.Choice(FORMATS), default="logfmt", show_default=True,
                     envvar=_env("LOG_FORMAT"), show_envvar=True,
                     help="Log lines as logfmt (key=value) or as one JSON object each (ts, level, logger, msg)."),
    ]


def _is_demo(source: str, demo: bool) -> bool:
    """``--demo`` and ``--source demo`` are one thing: the bundled GPU sample *and*
    its host's processes, never this host's /proc or kubelet."""
    return demo or source == "demo"


def _chosen_source(source: str, demo: bool) -> str:
    """The read path the flags name: ``demo`` for ``--demo``, and ``nvidia-smi`` for ``auto``
    with an explicit ``--nvidia-smi``, which says which path to read."""
    if demo:
        return "demo"
    if source == "auto" and click.get_current_context().get_parameter_source("nvidia_smi") not in (
        ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None,
    ):
        return "nvidia-smi"
    return source


def _make_source(source: str, nvidia_smi: str, timeout: float, *, strict: bool,
                 strict_about_path: bool = True, unready: str = "serving with read_success 0 until it is available",
                 activity_window: float = DEFAULT_WINDOW_S) -> Source:
    """The source ``source`` names (as ``_chosen_source`` gives it).

    ``strict`` (``read`` to stdout) refuses a source that cannot work now.
    Otherwise only an explicit ``--nvidia-smi`` path is refused
    (``strict_about_path``): a node whose driver is not installed yet still
    serves, with read_success 0 and the reason in the log, instead of
    crash-looping; ``read --output`` writes read_success 0 (``unready`` says
    which, in the log line).
    """
    if source == "demo":
        log.info("demo mode: serving the bundled sample, not a real GPU")
        return DemoSource()
    smi = NvidiaSmiSource(nvidia_smi, timeout)
    chosen: Source = smi
    if source == "nvml":
        chosen = NvmlSource(timeout_s=timeout, activity_window_s=activity_window)
    elif source == "auto":
        chosen = AutoSource(NvmlSource(timeout_s=timeout, activity_window_s=activity_window), smi)
    ok, reason = chosen.ready()
    if ok:
        log.info("reading through %s: %s", chosen.describe(), reason)
    elif strict or (strict_about_path and source == "nvidia-smi" and os.sep in nvidia_smi):
        raise click.ClickException(f"{reason} (give --nvidia-smi PATH, or --demo to try the exporter without a GPU)")
    else:
        log.warning("%s; %s", reason, unready)
    return chosen


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="mig-exporter", message="%(prog)s %(version)s")
def cli() -> None:
    """Prometheus exporter for NVIDIA GPU memory: per card, per MIG instance and per process."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors are one line each on stderr and a non-zero exit (2 for usage, 1 otherwise)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cli.main(args=args, prog_name="mig-exporter", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:  # a bare mig-exporter: the usage, no "error"
        click.echo(e.format_message(), err=True)
        sys.exit(2)
    except click.UsageError as e:
        # The parser raises some errors (an option without its value) with no
        # context: the command is then the first argument.
        command = e.ctx.command_path if e.ctx else " ".join(["mig-exporter", *args[:1]] if args[:1] and
                                                             args[0] in cli.commands else ["mig-exporter"])
        click.echo(f"mig-exporter: error: {e.format_message()} (see '{command} --help')", err=True)
        sys.exit(2)
    except click.ClickException as e:
        for line in e.format_message().splitlines():  # a bad config file: one line per error
            click.echo(f"mig-exporter: error: {line}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(1)


def _load_web_config(path: str) -> WebSettings:
    """The web config, or a ClickException listing every error in it."""
    try:
        web = WebSettings(path)
    except ConfigError as e:
        raise click.ClickException("\n".join(f"{e.source}: {error}" for error in e.errors)) from None
    log.info("loaded %s: %s", path, web.config.summary())
    return web


def _load_config(path: str) -> Config:
    """The config file, or a ClickException listing every error in it."""
    try:
        return load_config(path)
    except ConfigError as e:
        raise click.ClickException("\n".join(f"{e.source}: {error}" for error in e.errors)) from None


@cli.command()
@_source_options
@_with_options(_log_options("info"))
@_engine_options
@_kubernetes_options
@_slurm_options
@click.option("--web.listen-address", "listen_address", default=DEFAULT_LISTEN_ADDRESS, show_default=True,
              envvar=_env("WEB_LISTEN_ADDRESS"), show_envvar=True, help="HOST:PORT to serve on.")
@click.option("--web.timeout-offset", "timeout_offset", type=click.FloatRange(min=0), default=0.5,
              show_default=True, envvar=_env("WEB_TIMEOUT_OFFSET"), show_envvar=True,
              help="Seconds kept back from Prometheus' scrape timeout so the answer arrives in time.")
@click.option("--probe.max-concurrent", "max_concurrent", type=click.IntRange(min=1, max=1024),
              default=DEFAULT_MAX_CONCURRENT, show_default=True, envvar=_env("PROBE_MAX_CONCURRENT"),
              show_envvar=True, help="Probes that may run at once; beyond that /probe answers 503 at once.")
@click.option("--web.max-connections", "max_connections", type=click.IntRange(min=8, max=65536),
              default=Limits().max_connections, show_default=True, envvar=_env("WEB_MAX_CONNECTIONS"),
              show_envvar=True,
              help="Connections open at once. At the cap, the least useful one is closed (a client that has not "
                   "sent a whole request, oldest first; else the longest idle). Lowered to fit the open-file limit.")
@click.option("--web.config.file", "web_config_file", type=click.Path(dir_okay=False), default=None,
              envvar=_env("WEB_CONFIG_FILE"), show_envvar=True,
              help="exporter-toolkit web config (YAML): TLS (tls_server_config) and basic auth (basic_auth_users, "
                   "bcrypt). Re-read when it or its certificates change. docs/security.md.")
@click.option("--collector.xid/--no-collector.xid", "xid", default=True, show_default=True,
              envvar=_env("COLLECTOR_XID"), show_envvar=True,
              help="Count the XID errors the driver reports into mig_exporter_xid_errors_total: the kernel "
                   "log's lines (--collector.xid.kmsg) on every read path, and NVML's events (waited for in a "
                   "thread of their own) with --source nvml or auto. docs/xids.md.")
@_xid_kmsg_option()
@_process_series_option()
@_activity_window_option()
@click.option("--web.node-name", "node_name", metavar="NAME", default=None, envvar=_env("WEB_NODE_NAME"),
              show_envvar=True,
              help="The node the landing page (/) names; default: this host's name. In a pod, whose host name "
                   "is the pod's, give the node's (the chart sets it from spec.nodeName).")
def serve(source: str, nvidia_smi: str, timeout: float, demo: bool, log_level: str, log_format: str,
          config_file: str | None, proc_root: str, host_passwd: str | None, kubernetes: bool,
          pod_resources_socket: str, kubelet_log_dir: str, slurm_job_map_dir: str | None,
          listen_address: str, timeout_offset: float, max_concurrent: int, max_connections: int,
          web_config_file: str | None, xid: bool, xid_kmsg: str, process_series: ProcessSeries,
          activity_window: float, node_name: str | None) -> None:
    """Serve /metrics, and /probe for the targets of --config.file; every scrape reads afresh."""
    setup_logging(log_level, log_format)
    log.debug("%s", limit_arenas())  # before any thread of ours starts
    before, after = raise_open_file_limit()
    log.debug("open-file limit %d, raised from %d", after, before)
    server = build_server(
        source=_chosen_source(source, _is_demo(source, demo)), nvidia_smi=nvidia_smi, timeout=timeout,
        config_file=config_file, proc_root=proc_root, host_passwd=host_passwd, kubernetes=kubernetes,
        pod_resources_socket=pod_resources_socket, kubelet_log_dir=kubelet_log_dir,
        slurm_job_map_dir=slurm_job_map_dir, listen_address=listen_address, timeout_offset=timeout_offset,
        max_concurrent=max_concurrent, max_connections=max_connections, web_config_file=web_config_file, xid=xid,
        xid_kmsg=xid_kmsg, process_series=process_series, node_name=node_name or None,
        activity_window=activity_window,
    )
    _run(server)


def build_server(*, source: str, nvidia_smi: str, timeout: float, config_file: str | None, proc_root: str,
                 host_passwd: str | None, kubernetes: bool, pod_resources_socket: str, kubelet_log_dir: str,
                 slurm_job_map_dir: str | None, listen_address: str, timeout_offset: float, max_concurrent: int,
                 max_connections: int, web_config_file: str | None, xid: bool = True, xid_kmsg: str = DEFAULT_KMSG,
                 process_series: ProcessSeries = ALL_PROCESSES, node_name: str | None = None,
                 activity_window: float = DEFAULT_WINDOW_S) -> ExporterServer:
    """The server serve runs, listening and assembled from serve's options (``source`` as
    ``_chosen_source`` names it): the source and the scrape with its readers, the probe targets,
    the one exporter that composes their metrics, the web config. A bad option or file is a
    ``click.ClickException``."""
    demo = source == "demo"
    try:
        address = parse_listen_address(listen_address)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--web.listen-address") from None
    config = _load_config(config_file) if config_file else EMPTY
    engines = _make_engine_reader(config.engines, proc_root, demo)
    prober = None
    if config_file is not None:
        prober = Prober(config, max_concurrent=max_concurrent, default_timeout_s=timeout, config_file=config_file,
                        on_reload=lambda new: setattr(engines, "settings", new.engines))
        log.info("loaded %s: %s; at most %d probes at once", config_file, config.summary(), max_concurrent)
    web = _load_web_config(web_config_file) if web_config_file else None
    scraper = _make_scraper(_make_source(source, nvidia_smi, timeout, strict=False, activity_window=activity_window),
                            engines, proc_root=proc_root,
                            host_passwd=host_passwd, kubernetes=kubernetes,
                            pod_resources_socket=pod_resources_socket, kubelet_log_dir=kubelet_log_dir,
                            slurm_job_map_dir=slurm_job_map_dir, demo=demo, process_series=process_series)
    if process_series != ALL_PROCESSES:
        log.info("per-process series: %s (--collector.processes)", process_series)
    if xid and source in ("nvml", "auto"):  # NVML's events: the nvidia-smi path has none
        scraper.xids = XidListener()
    if xid:  # the kernel's lines: on every read path
        scraper.kmsg = _make_kmsg_reader(xid_kmsg, demo)
    # /metrics: the scrape's families, then the counters about probes.
    exporter = Exporter(scraper, *([prober] if prober is not None else []), timeout_s=timeout)
    try:
        server = ExporterServer(address, exporter, timeout_offset_s=timeout_offset, prober=prober, web=web,
                                limits=Limits(max_connections=max_connections), node_name=node_name)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {listen_address}: {e.strerror or e}") from None
    if scraper.xids is not None:
        scraper.xids.start()  # once listening: a server that cannot start leaves no thread behind
    return server


def _run(server: ExporterServer) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads the config file."""
    prober = server.prober
    # A handler runs in the main thread between two bytecodes, whatever lock that thread holds
    # (threading's own in Thread.start, logging's, a reloader's): it only queues the signal
    # (SimpleQueue.put is reentrant), and a thread started here acts on it.
    received: queue.SimpleQueue[int] = queue.SimpleQueue()

    def act() -> None:
        while True:
            signum = received.get()
            try:
                if signum != signal.SIGHUP:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    server.shutdown()
                elif prober is None:
                    log.info("received SIGHUP; no --config.file, nothing to reload")
                else:
                    log.info("received SIGHUP, reloading %s", prober.config_file)
                    prober.request_reload(0)  # the reloader's thread reads; this one waits for nothing
            except Exception:  # a bug of ours: logged, and the next signal is still acted on
                log.exception("acting on %s failed", signal.Signals(signum).name)

    threading.Thread(target=act, name="signals", daemon=True).start()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda signum, _frame: received.put(signum))
    log.info("mig-exporter %s listening on %s (source: %s)", __version__, server.listening,
             server.exporter.source.describe())
    # What is alive now (modules, the parsers' tables) lives until exit; frozen,
    # the cyclic collector stops walking it at each full collection, a scrape's
    # largest cost after the work itself on a node with many processes.
    gc.freeze()
    # A child subreaper: what a read's commands leave behind is handed to us, to kill and reap.
    with _reaping(), server:
        server.serve_forever()
        # Reads still in flight would otherwise leave nvidia-smi running.
        killed = kill_running()
        if server.exporter.scraper.xids is not None:
            server.exporter.scraper.xids.stop(timeout=2.0)
    if killed:
        log.info("killed %d command(s) still running at shutdown", killed)


@cli.command("check-config")
@click.argument("config_file", metavar="FILE")
def check_config(config_file: str) -> None:
    """Check a config file: print every error and exit 1, or a summary and exit 0."""
    config = _load_config(config_file)
    click.echo(f"{config_file}: ok: {config.summary()}")
    # Not errors: the file may be checked on another host than the one that runs it.
    for target in config.probe_targets.values():
        try:
            NvidiaSmiSource(target.command).resolve()
        except CommandError as e:
            click.echo(f"mig-exporter: warning: {config_file}: probe_targets.{target.name}: {e} (on this host)",
                       err=True)


@cli.command("check-web-config")
@click.argument("web_config_file", metavar="FILE")
def check_web_config(web_config_file: str) -> None:
    """Check a web config file (TLS, basic auth), certificates and keys included: print every error and
    exit 1, or a summary and exit 0."""
    try:
        config = load_web_config(web_config_file)
    except ConfigError as e:
        raise click.ClickException("\n".join(f"{e.source}: {error}" for error in e.errors)) from None
    click.echo(f"{web_config_file}: ok: {config.summary()}")


def _one_read_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """What read and status, which read once, take: the source, the log (warning, not info: read
    runs from cron, where every line on stderr is mail), and the host's readers."""
    for options in reversed((_source_options, _with_options(_log_options("warning")), _engine_options,
                             _kubernetes_options, _slurm_options)):
        func = options(func)
    return func


@cli.command()
@_one_read_options
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), default=None,
              envvar=_env("OUTPUT"), show_envvar=True,
              help="Write to FILE atomically (for node_exporter's textfile collector) instead of stdout.")
@_xid_kmsg_option()
@_process_series_option()
@_activity_window_option()
def read(source: str, nvidia_smi: str, timeout: float, demo: bool, log_level: str, log_format: str,
         config_file: str | None, proc_root: str, host_passwd: str | None, kubernetes: bool,
         pod_resources_socket: str, kubelet_log_dir: str, slurm_job_map_dir: str | None,
         output: str | None, xid_kmsg: str, process_series: ProcessSeries, activity_window: float) -> None:
    """Read once and print the metrics in the Prometheus text format."""
    setup_logging(log_level, log_format)
    demo = _is_demo(source, demo)
    config = _load_config(config_file) if config_file else EMPTY
    engines = _make_engine_reader(config.engines, proc_root, demo)
    # With --output a source that cannot work still gives a read: read_success 0
    # replaces the file, so node_exporter never goes on serving an old success.
    chosen = _make_source(_chosen_source(source, demo), nvidia_smi, timeout, strict=output is None,
                          strict_about_path=False, unready=f"writing read_success 0 to {output}",
                          activity_window=activity_window)
    scraper = _make_scraper(chosen, engines, proc_root=proc_root, host_passwd=host_passwd, kubernetes=kubernetes,
                            pod_resources_socket=pod_resources_socket, kubelet_log_dir=kubelet_log_dir,
                            slurm_job_map_dir=slurm_job_map_dir, demo=demo, process_series=process_series)
    scraper.kmsg = _make_kmsg_reader(xid_kmsg, demo)  # the XIDs since boot: a one-shot read has them too
    with _reaping(), _signals_kill_commands():
        _first_activity_sample(chosen, timeout)
        # serve's answer to a scrape without a header, text format: the same exporter and encoder.
        text, _content_type = Exporter(scraper, timeout_s=timeout).answer(Deadline.after(timeout)).encoded(None, False)
    if output is None:
        sys.stdout.buffer.write(text)
        sys.stdout.buffer.flush()
    else:
        try:
            _write_atomically(output, text)
        except OSError as e:
            raise click.ClickException(f"cannot write {output}: {e.strerror or e}") from None
    if scraper.errors_total:
        sys.exit(1)


@cli.command()
@_one_read_options
@click.option("--output", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="A table for a person, or JSON for scripts.")
def status(source: str, nvidia_smi: str, timeout: float, demo: bool, log_level: str, log_format: str,
           config_file: str | None, proc_root: str, host_passwd: str | None, kubernetes: bool,
           pod_resources_socket: str, kubelet_log_dir: str, slurm_job_map_dir: str | None,
           output_format: str) -> None:
    """This node at a glance: each device with its class, memory and processes, the top process
    with its pod, job or unit, and the devices counted by class. Reads once, as read does; exit 1
    when the read failed."""
    setup_logging(log_level, log_format)
    demo = _is_demo(source, demo)
    config = _load_config(config_file) if config_file else EMPTY
    engines = _make_engine_reader(config.engines, proc_root, demo)
    chosen = _make_source(_chosen_source(source, demo), nvidia_smi, timeout, strict=True)
    scraper = _make_scraper(chosen, engines, proc_root=proc_root, host_passwd=host_passwd, kubernetes=kubernetes,
                            pod_resources_socket=pod_resources_socket, kubelet_log_dir=kubelet_log_dir,
                            slurm_job_map_dir=slurm_job_map_dir, demo=demo)
    with _reaping(), _signals_kill_commands():
        outcome = scraper.read(Deadline.after(timeout))
    if output_format == "json":
        click.echo(json.dumps(status_view.as_json(outcome), indent=2))
    else:
        click.echo(status_view.render_text(outcome), nl=False)
    if not outcome.success:
        sys.exit(1)


class _HeaderType(click.ParamType):  # type: ignore[type-arg]
    """``NAME:VALUE`` for --prometheus.header; from the environment, one per line. The value is
    never echoed in an error."""

    name = "NAME:VALUE"

    def split_envvar_value(self, rv: str) -> list[str]:
        return [line for line in rv.splitlines() if line.strip()]

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        try:
            return prometheus_api.parse_header(value)
        except prometheus_api.FleetUsageError as e:
            self.fail(str(e), param, ctx)


class _CannotAsk(click.ClickException):
    exit_code = 3


class _UnknownClass(click.ClickException):
    exit_code = 2


@cli.command()
@click.option("--prometheus", "prometheus_url", metavar="URL", required=True, envvar=_env("PROMETHEUS_URL"),
              show_envvar=True,
              help="The Prometheus (or Thanos Query, Mimir, VictoriaMetrics) that scrapes the exporters, e.g. "
                   "http://prometheus:9090 (with its path prefix where it has one: http://mimir/prometheus); asked "
                   "through its HTTP query API. Credentials in the URL are refused.")
@click.option("--class", "device_class", metavar="CLASS", default=None,
              help="Also list the nodes that have a free device of this class now (e.g. a100-80g-mig-3g.40gb).")
@click.option("--devices", is_flag=True, default=False,
              help="With --class: list each free device (node, card/migN, MIG or GPU UUID for CUDA_VISIBLE_DEVICES, "
                   "GPU instance id, memory free), as status --output json gives them.")
@click.option("--output", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="A table for a person, or JSON for scripts.")
@click.option("--timeout", type=click.FloatRange(min=0.1, max=600), default=10.0, show_default=True,
              help="Seconds the whole exchange with the Prometheus may take (all its queries together).")
@click.option("--prometheus.basic-auth-user", "basic_auth_user", metavar="USER", default=None,
              envvar=_env("PROMETHEUS_BASIC_AUTH_USER"), show_envvar=True,
              help="Basic auth user; the password comes from --prometheus.password-file, else from the environment "
                   f"variable {prometheus_api.PASSWORD_ENV}.")
@click.option("--prometheus.password-file", "password_file", metavar="FILE", type=click.Path(dir_okay=False),
              default=None, envvar=_env("PROMETHEUS_PASSWORD_FILE"), show_envvar=True,
              help="File holding the basic auth password (surrounding whitespace removed).")
@click.option("--prometheus.bearer-token-file", "bearer_token_file", metavar="FILE", type=click.Path(dir_okay=False),
              default=None, envvar=_env("PROMETHEUS_BEARER_TOKEN_FILE"), show_envvar=True,
              help="File holding a bearer token, sent as 'Authorization: Bearer ...' (not with basic auth).")
@click.option("--prometheus.header", "headers", type=_HeaderType(), multiple=True,
              envvar=_env("PROMETHEUS_HEADER"), show_envvar=True,
              help="A header sent with each query, e.g. X-Scope-OrgID:tenant-1 for Mimir or Cortex; repeatable "
                   "(from the environment: one per line). A value with a line break is refused.")
@click.option("--prometheus.ca-file", "ca_file", metavar="FILE", type=click.Path(dir_okay=False), default=None,
              envvar=_env("PROMETHEUS_CA_FILE"), show_envvar=True,
              help="PEM CA certificate(s) that verify an https:// server, in place of the system's.")
@click.option("--capacity.fresh-within", "fresh_within", metavar="DURATION", default=fleet_view.DEFAULT_FRESH_WITHIN,
              show_default=True, envvar=_env("CAPACITY_FRESH_WITHIN"), show_envvar=True,
              help="A node counts while its newest read is younger than this: the capacity rules' window "
                   "(the chart's prometheusRule.capacityFreshWithin). Give the same as your rules.")
def fleet(prometheus_url: str, device_class: str | None, devices: bool, output_format: str, timeout: float,
          basic_auth_user: str | None, password_file: str | None, bearer_token_file: str | None,
          headers: tuple[tuple[str, str], ...], ca_file: str | None, fresh_within: str) -> None:
    """The fleet by device class, from a Prometheus: devices, free, in use and unknown per class,
    the nodes that stopped reporting, and with --class the nodes that have one free now (with
    --devices, each free device). Free: docs/capacity.md. No password, token or header value is
    ever printed.

    \b
    Exit status:
      0  it answered; with --class, a device of the class is free
      1  with --class: none of the class is free
      2  a usage error, or a --class the Prometheus has no device of (the message names its classes)
      3  it could not ask: unreachable, an HTTP error (401, 404, ...), not a Prometheus, TLS
    """
    if devices and device_class is None:
        raise click.UsageError("--devices lists the free devices of one class: give --class")
    try:
        queries = fleet_view.QUERIES.fresh_within(fresh_within)
        client = prometheus_api.PrometheusClient(prometheus_url, timeout, prometheus_api.access(
            user=basic_auth_user, password_file=password_file,
            password_env=os.environ.get(prometheus_api.PASSWORD_ENV) or None, bearer_token_file=bearer_token_file,
            headers=headers, ca_file=ca_file))
    except prometheus_api.FleetUsageError as e:
        raise click.UsageError(str(e)) from None
    try:
        found = fleet_view.read_fleet(client, device_class, devices=devices, queries=queries)
    except prometheus_api.FleetError as e:
        raise _CannotAsk(f"cannot ask the Prometheus: {e}") from None
    if device_class is not None and not found.knows(device_class):
        raise _UnknownClass(f"the Prometheus has no device of class {device_class!a}; its classes: "
                            f"{fleet_view.known_classes(found)}")
    if output_format == "json":
        click.echo(json.dumps(fleet_view.as_json(found), indent=2))
    else:
        click.echo(fleet_view.render_text(found, device_class), nl=False)
    if device_class is not None and not found.any_free:
        sys.exit(1)


@cli.command()
@_nvidia_smi_option()
@_timeout_option("Seconds each read may take.")
@click.option("--slow-threshold", type=click.FloatRange(min=0), default=DEFAULT_SLOW_THRESHOLD_S, show_default=True,
              envvar=_env("DOCTOR_SLOW_THRESHOLD"), show_envvar=True,
              help="Warn when nvidia-smi takes longer than this many seconds.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              envvar=_env("DOCTOR_FORMAT"), show_envvar=True, help="Human-readable text, or JSON for machines.")
@click.option("--demo", is_flag=True, default=False, envvar=_env("DEMO"), show_envvar=True,
              help="Diagnose the bundled sample (an A100 in MIG mode and a whole A100) instead of this host: "
                   "what a report looks like; its whole A100 has a pending row remap, so it exits 3.")
@click.option("--proc.root", "proc_root", metavar="DIR", default=DEFAULT_PROC_ROOT, show_default=True,
              envvar=_env("PROC_ROOT"), show_envvar=True,
              help="The /proc that tells whether the host's PIDs are seen (without them no device counts free).")
@_kubernetes_options
@_slurm_options
@_xid_kmsg_option()
@_with_options(_log_options("warning"))
def doctor(nvidia_smi: str, timeout: float, slow_threshold: float, output_format: str, demo: bool, proc_root: str,
           kubernetes: bool, pod_resources_socket: str, kubelet_log_dir: str, slurm_job_map_dir: str | None,
           xid_kmsg: str, log_level: str, log_format: str) -> None:
    """Read through NVML and nvidia-smi, show each card, and say what is wrong. Each device's
    state counts the allocations to pods and Slurm jobs, read as status reads them.

    Exit codes: 0 when at least one path reads and nothing is wrong with the GPUs (warnings such as one
    unavailable path or a slow nvidia-smi may remain); 1 when workloads cannot run or the numbers are
    wrong (an error); 3 when a card needs a reset or replacing (its health: a pending row remap or page
    retirement, the driver's recovery action, a failed row remap), before 1; 2 when nothing can be read.
    """
    setup_logging(log_level, log_format)
    nvml_read: PathReading | None = None
    if demo:
        # The sample is nvidia-smi's output: there is no NVML to read.
        source: Source = DemoSource()
        smi_read = timed_read("demo", source.read)
        host_pids: bool | None = DemoProcs().read_namespace().is_host
    else:
        nvml = NvmlSource(timeout_s=timeout)
        source = NvidiaSmiSource(nvidia_smi, timeout)
        with _signals_kill_commands():
            _first_activity_sample(nvml, timeout)
            # One after the other, each with the whole --timeout (each source's own).
            nvml_read, smi_read = timed_read("nvml", nvml.read), timed_read("nvidia-smi", source.read)
        host_pids = _sees_host_pids(proc_root)
    # The allocations' readers as status makes them (none of the kubelet's in the demo).
    scraper = Scraper(source, pods=_make_pod_reader(kubernetes, proc_root, pod_resources_socket, kubelet_log_dir, demo),
                      job_map=_make_job_map(slurm_job_map_dir))
    host, problems = _doctor_host(scraper, shown_snapshot((nvml_read, smi_read)), host_pids, timeout)
    kmsg_reads = kmsg_status(_kmsg_path(xid_kmsg, demo))  # the demo's is its bundled sample
    report = diagnose(nvml_read, smi_read, slow_threshold_s=slow_threshold, host=host, allocation_problems=problems,
                      kmsg=kmsg_reads)
    if output_format == "json":
        click.echo(json.dumps(as_json(report), indent=2))
    else:
        click.echo(render_text(report), nl=False)
    sys.exit(report.exit_code)


# The share of --timeout the first NVML read of doctor and read may take: it only takes GPM's first
# sample, and a driver that hangs must not cost them their whole timeout twice.
FIRST_SAMPLE_SHARE_OF_TIMEOUT = 0.25


def _first_activity_sample(source: Source, timeout_s: float) -> None:
    """GPM gives a device's activity between two samples at least a second apart: where a first
    NVML read finds GPM, wait that second, so the read doctor shows (or read prints) has the
    activity, not "first_sample" (issue 39). A one-shot command's GPM window is that second, whatever
    --collector.activity.window (doctor's output says "over the last 1 s"); its process activity
    still averages the driver's buffer over the window. What this read finds wrong, the read that
    counts finds again. Where no card has GPM there is no wait, only this extra NVML read (a few
    milliseconds). nvidia-smi has no GPM here: it is not read twice; nor is a source auto has not
    chosen yet (its choice would run outside this bounded read)."""
    try:
        chosen = source.chosen if isinstance(source, AutoSource) else source
        if not isinstance(chosen, NvmlSource):
            return
        snapshot = chosen.read(Deadline.after(timeout_s * FIRST_SAMPLE_SHARE_OF_TIMEOUT))
    except Exception:  # reported by the timed read that follows
        return
    if any(d.activity_unknown == ACTIVITY_FIRST_SAMPLE for d in snapshot.devices):
        time.sleep(MIN_INTERVAL_S + 0.1)


def _doctor_host(scraper: Scraper, snapshot: Snapshot | None, host_pids: bool | None,
                 timeout: float) -> tuple[HostView, tuple[str, ...]]:
    """What decides doctor's device states beyond its read, as for status: whether the host's
    PIDs are seen, and the allocations of ``snapshot`` (the one doctor shows), read once through
    the scraper's readers within ``timeout``; with what reading them found wrong."""
    if snapshot is None:
        return HostView(host_pids), ()
    pods, job_map = scraper.read_allocations(snapshot, Deadline.after(timeout))
    problems = (pods.problems if pods is not None else ()) + (job_map.problems if job_map is not None else ())
    return dataclasses.replace(host_view(None, pods, job_map), host_pids=host_pids), problems


def _sees_host_pids(proc_root: str) -> bool | None:
    """Whether this process sees the host's PIDs through ``proc_root`` (None: cannot tell)."""
    try:
        return ProcfsSource(proc_root).read_namespace().is_host
    except ProcError:
        return None


@contextlib.contextmanager
def _reaping() -> Iterator[None]:
    """This process reaps what its commands leave (command.reaping), and says so when it cannot."""
    with reaping() as subreaper:
        if not subreaper and os.getpid() != 1:
            log.warning("cannot become a child subreaper (prctl PR_SET_CHILD_SUBREAPER refused): children that "
                        "leave nvidia-smi's process group may outlive their read")
        yield


@contextlib.contextmanager
def _signals_kill_commands() -> Iterator[None]:
    """Reads run in worker threads: SIGTERM or SIGINT must take their commands
    down explicitly, or those outlive us in their own sessions."""
    previous = {sig: signal.signal(sig, _kill_and_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _kill_and_exit(signum: int, _frame: object) -> None:
    """SIGTERM or SIGINT during a read: take the read's commands down with us."""
    kill_running()
    sys.exit(128 + signum)


def _write_atomically(path: str, data: bytes) -> None:
    """Write beside the target and rename over it, so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".mig-exporter.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
