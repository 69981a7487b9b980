"""The ``mig-exporter`` command: ``serve`` and ``read``.

Every option can also be set from the environment: ``--timeout`` from
``MIG_EXPORTER_TIMEOUT``, ``--web.listen-address`` from
``MIG_EXPORTER_WEB_LISTEN_ADDRESS``, and so on (``--help`` shows each).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource
from prometheus_client import CollectorRegistry, generate_latest

from mig_exporter import __version__
from mig_exporter.command import kill_running
from mig_exporter.doctor import DEFAULT_SLOW_THRESHOLD_S, as_json, diagnose, render_text, timed_read
from mig_exporter.scrape import ScrapeCollector, Scraper, Source
from mig_exporter.server import DEFAULT_LISTEN_ADDRESS, ExporterServer, parse_listen_address
from mig_exporter.source_auto import AutoSource
from mig_exporter.source_demo import DemoSource
from mig_exporter.source_nvml import NvmlSource
from mig_exporter.source_smi import DEFAULT_BINARY, DEFAULT_TIMEOUT_S, NvidiaSmiSource

ENV_PREFIX = "MIG_EXPORTER_"
log = logging.getLogger("mig_exporter")


def _env(name: str) -> str:
    return ENV_PREFIX + name


SOURCES = ("auto", "nvml", "nvidia-smi", "demo")


def _source_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--source", type=click.Choice(SOURCES), default="auto", show_default=True,
                     envvar=_env("SOURCE"), show_envvar=True,
                     help="Where to read: NVML (libnvidia-ml), nvidia-smi, or the bundled demo sample. "
                          "auto takes NVML where the library loads, else nvidia-smi (nvidia-smi when "
                          "--nvidia-smi is given)."),
        click.option("--nvidia-smi", "nvidia_smi", default=DEFAULT_BINARY, show_default=True,
                     envvar=_env("NVIDIA_SMI"), show_envvar=True,
                     help="The nvidia-smi binary: a path, or a name looked up on PATH."),
        click.option("--timeout", type=click.FloatRange(min=0.1, max=600), default=DEFAULT_TIMEOUT_S,
                     show_default=True, envvar=_env("TIMEOUT"), show_envvar=True,
                     help="Seconds a read may take; at the deadline the command's process group is killed."),
        click.option("--demo", is_flag=True, default=False, envvar=_env("DEMO"), show_envvar=True,
                     help="Same as --source demo: the bundled sample (an A100 in MIG mode and a whole A100)."),
        click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                     show_default=True, envvar=_env("LOG_LEVEL"), show_envvar=True, help="Log verbosity."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
        force=True,
    )


def _make_source(source: str, nvidia_smi: str, timeout: float, demo: bool, *, strict: bool) -> Source:
    """The source the flags ask for.

    ``strict`` (``read``) refuses a source that cannot work now. ``serve`` is
    strict only about an explicit ``--nvidia-smi`` path: a node whose driver is
    not installed yet still serves, with read_success 0 and the reason in the
    log, instead of crash-looping.
    """
    ctx = click.get_current_context()
    if demo:
        source = "demo"
    elif source == "auto" and ctx.get_parameter_source("nvidia_smi") not in (
        ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None,
    ):
        source = "nvidia-smi"  # an explicit --nvidia-smi says which path to read
    if source == "demo":
        log.info("demo mode: serving the bundled sample, not a real GPU")
        return DemoSource()
    smi = NvidiaSmiSource(nvidia_smi, timeout)
    chosen: Source = smi
    if source == "nvml":
        chosen = NvmlSource(timeout_s=timeout)
    elif source == "auto":
        chosen = AutoSource(NvmlSource(timeout_s=timeout), smi)
    ok, reason = chosen.ready()
    if ok:
        log.info("reading through %s: %s", chosen.describe(), reason)
    elif strict or (source == "nvidia-smi" and os.sep in nvidia_smi):
        raise click.ClickException(f"{reason} (give --nvidia-smi PATH, or --demo to try the exporter without a GPU)")
    else:
        log.warning("%s; serving with read_success 0 until it is available", reason)
    return chosen


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="mig-exporter", message="%(prog)s %(version)s")
def cli() -> None:
    """Prometheus exporter for NVIDIA GPU memory: per card, per MIG instance and per process."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors are one line on stderr and a non-zero exit (2 for usage, 1 otherwise)."""
    try:
        cli.main(args=argv, prog_name="mig-exporter", standalone_mode=False)
    except click.UsageError as e:
        command = e.ctx.command_path if e.ctx else "mig-exporter"
        click.echo(f"mig-exporter: error: {e.format_message()} (see '{command} --help')", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"mig-exporter: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(1)


@cli.command()
@_source_options
@click.option("--web.listen-address", "listen_address", default=DEFAULT_LISTEN_ADDRESS, show_default=True,
              envvar=_env("WEB_LISTEN_ADDRESS"), show_envvar=True, help="HOST:PORT to serve on.")
@click.option("--web.timeout-offset", "timeout_offset", type=click.FloatRange(min=0), default=0.5,
              show_default=True, envvar=_env("WEB_TIMEOUT_OFFSET"), show_envvar=True,
              help="Seconds kept back from Prometheus' scrape timeout so the answer arrives in time.")
def serve(source: str, nvidia_smi: str, timeout: float, demo: bool, log_level: str, listen_address: str,
          timeout_offset: float) -> None:
    """Serve /metrics; every scrape reads the GPUs afresh."""
    _setup_logging(log_level)
    try:
        address = parse_listen_address(listen_address)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--web.listen-address") from None
    chosen = _make_source(source, nvidia_smi, timeout, demo, strict=False)
    try:
        server = ExporterServer(address, Scraper(chosen), timeout_s=timeout, timeout_offset_s=timeout_offset)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {listen_address}: {e.strerror or e}") from None

    def stop(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("mig-exporter %s listening on %s (source: %s)", __version__, server.url, chosen.describe())
    # What is alive now (modules, the parsers' tables) lives until exit; frozen,
    # the cyclic collector stops walking it at each full collection, a scrape's
    # largest cost after the work itself on a node with many processes.
    gc.freeze()
    with server:
        server.serve_forever()
    # Reads still in flight would otherwise leave nvidia-smi running.
    killed = kill_running()
    if killed:
        log.info("killed %d command(s) still running at shutdown", killed)


@cli.command()
@_source_options
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), default=None,
              envvar=_env("OUTPUT"), show_envvar=True,
              help="Write to FILE atomically (for node_exporter's textfile collector) instead of stdout.")
def read(source: str, nvidia_smi: str, timeout: float, demo: bool, log_level: str, output: str | None) -> None:
    """Read once and print the metrics in the Prometheus text format."""
    _setup_logging(log_level)
    scraper = Scraper(_make_source(source, nvidia_smi, timeout, demo, strict=True))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeCollector(scraper, timeout))
    previous = signal.signal(signal.SIGTERM, _kill_and_exit)
    try:
        text = generate_latest(registry)
    finally:
        signal.signal(signal.SIGTERM, previous)
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
@click.option("--nvidia-smi", "nvidia_smi", default=DEFAULT_BINARY, show_default=True,
              envvar=_env("NVIDIA_SMI"), show_envvar=True,
              help="The nvidia-smi binary: a path, or a name looked up on PATH.")
@click.option("--timeout", type=click.FloatRange(min=0.1, max=600), default=DEFAULT_TIMEOUT_S,
              show_default=True, envvar=_env("TIMEOUT"), show_envvar=True, help="Seconds each read may take.")
@click.option("--slow-threshold", type=click.FloatRange(min=0), default=DEFAULT_SLOW_THRESHOLD_S, show_default=True,
              envvar=_env("DOCTOR_SLOW_THRESHOLD"), show_envvar=True,
              help="Warn when nvidia-smi takes longer than this many seconds.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              envvar=_env("DOCTOR_FORMAT"), show_envvar=True, help="Human-readable text, or JSON for machines.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True, envvar=_env("LOG_LEVEL"), show_envvar=True, help="Log verbosity.")
def doctor(nvidia_smi: str, timeout: float, slow_threshold: float, output_format: str, log_level: str) -> None:
    """Read through NVML and nvidia-smi, show each card, and warn of what is wrong.

    Exits 1 when there is any warning, 0 when there is none.
    """
    _setup_logging(log_level)
    nvml = NvmlSource(timeout_s=timeout)
    smi = NvidiaSmiSource(nvidia_smi, timeout)
    report = diagnose(
        timed_read("nvml", nvml.read),
        timed_read("nvidia-smi", smi.read),
        slow_threshold_s=slow_threshold,
    )
    if output_format == "json":
        click.echo(json.dumps(as_json(report), indent=2))
    else:
        click.echo(render_text(report), nl=False)
    sys.exit(1 if report.findings else 0)


def _kill_and_exit(signum: int, _frame: object) -> None:
    """SIGTERM during a read: take the read's commands down with us."""
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
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
