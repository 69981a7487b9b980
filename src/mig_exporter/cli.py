"""The ``mig-exporter`` command: ``serve`` and ``read``.

Every option can also be set from the environment: ``--timeout`` from
``MIG_EXPORTER_TIMEOUT``, ``--web.listen-address`` from
``MIG_EXPORTER_WEB_LISTEN_ADDRESS``, and so on (``--help`` shows each).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import click
from prometheus_client import CollectorRegistry, generate_latest

from mig_exporter import __version__
from mig_exporter.attribution import EngineWatch
from mig_exporter.command import kill_running
from mig_exporter.engines import DEFAULT_SETTINGS, ConfigError, read_config_file
from mig_exporter.errors import CommandError
from mig_exporter.procfs import DEFAULT_ROOT as DEFAULT_PROC_ROOT
from mig_exporter.procfs import ProcfsSource
from mig_exporter.scrape import ScrapeCollector, Scraper, Source
from mig_exporter.server import DEFAULT_LISTEN_ADDRESS, ExporterServer, parse_listen_address
from mig_exporter.source_demo import DemoProcs, DemoSource
from mig_exporter.source_smi import DEFAULT_BINARY, DEFAULT_TIMEOUT_S, NvidiaSmiSource

ENV_PREFIX = "MIG_EXPORTER_"
log = logging.getLogger("mig_exporter")


def _env(name: str) -> str:
    return ENV_PREFIX + name


def _source_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--nvidia-smi", "nvidia_smi", default=DEFAULT_BINARY, show_default=True,
                     envvar=_env("NVIDIA_SMI"), show_envvar=True,
                     help="The nvidia-smi binary: a path, or a name looked up on PATH."),
        click.option("--timeout", type=click.FloatRange(min=0.1, max=600), default=DEFAULT_TIMEOUT_S,
                     show_default=True, envvar=_env("TIMEOUT"), show_envvar=True,
                     help="Seconds a read may take; at the deadline the command's process group is killed."),
        click.option("--demo", is_flag=True, default=False, envvar=_env("DEMO"), show_envvar=True,
                     help="Read the bundled sample (an A100 in MIG mode and a whole A100, and its host's processes) "
                          "instead of a GPU and /proc."),
        click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                     show_default=True, envvar=_env("LOG_LEVEL"), show_envvar=True, help="Log verbosity."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--config.file", "config_file", type=click.Path(dir_okay=False), default=None,
                     envvar=_env("CONFIG_FILE"), show_envvar=True,
                     help="YAML config file. Its engines: section says which processes are inference engines "
                          "(docs/engines.md); without it every built-in preset is on."),
        click.option("--proc.root", "proc_root", metavar="DIR", default=DEFAULT_PROC_ROOT, show_default=True,
                     envvar=_env("PROC_ROOT"), show_envvar=True,
                     help="The /proc to read processes from, e.g. /host/proc in a container that mounts the host's."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _make_engine_watch(config_file: str | None, proc_root: str, demo: bool) -> EngineWatch:
    """Engine settings from the config file, over /proc or the demo's processes."""
    try:
        settings = read_config_file(config_file) if config_file else DEFAULT_SETTINGS
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    watch = EngineWatch(settings, DemoProcs() if demo else ProcfsSource(proc_root))
    log.info("watching %s", watch.describe())
    return watch


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s",
        force=True,
    )


def _make_source(nvidia_smi: str, timeout: float, demo: bool, *, strict: bool) -> Source:
    """The source the flags ask for.

    ``strict`` refuses a binary that cannot be found. ``serve`` is strict only
    about an explicit path: a node whose driver is not installed yet still
    serves, with read_success 0, instead of crash-looping.
    """
    if demo:
        log.info("demo mode: serving the bundled sample, not a real GPU")
        return DemoSource()
    source = NvidiaSmiSource(nvidia_smi, timeout)
    try:
        path = source.resolve()
        log.info("reading through %s", path)
    except CommandError as e:
        if strict or os.sep in nvidia_smi:
            raise click.ClickException(f"{e} (give --nvidia-smi PATH, or --demo to try the exporter without a GPU)") from None
        log.warning("%s; serving with read_success 0 until it appears", e)
    return source


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
@_engine_options
@click.option("--web.listen-address", "listen_address", default=DEFAULT_LISTEN_ADDRESS, show_default=True,
              envvar=_env("WEB_LISTEN_ADDRESS"), show_envvar=True, help="HOST:PORT to serve on.")
@click.option("--web.timeout-offset", "timeout_offset", type=click.FloatRange(min=0), default=0.5,
              show_default=True, envvar=_env("WEB_TIMEOUT_OFFSET"), show_envvar=True,
              help="Seconds kept back from Prometheus' scrape timeout so the answer arrives in time.")
def serve(nvidia_smi: str, timeout: float, demo: bool, log_level: str, config_file: str | None, proc_root: str,
          listen_address: str, timeout_offset: float) -> None:
    """Serve /metrics; every scrape reads the GPUs afresh."""
    _setup_logging(log_level)
    try:
        address = parse_listen_address(listen_address)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--web.listen-address") from None
    engines = _make_engine_watch(config_file, proc_root, demo)
    source = _make_source(nvidia_smi, timeout, demo, strict=False)
    try:
        server = ExporterServer(address, Scraper(source, engines), timeout_s=timeout, timeout_offset_s=timeout_offset)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {listen_address}: {e.strerror or e}") from None

    def stop(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("mig-exporter %s listening on %s (source: %s)", __version__, server.url, source.describe())
    with server:
        server.serve_forever()
    # Reads still in flight would otherwise leave nvidia-smi running.
    killed = kill_running()
    if killed:
        log.info("killed %d command(s) still running at shutdown", killed)


@cli.command()
@_source_options
@_engine_options
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), default=None,
              envvar=_env("OUTPUT"), show_envvar=True,
              help="Write to FILE atomically (for node_exporter's textfile collector) instead of stdout.")
def read(nvidia_smi: str, timeout: float, demo: bool, log_level: str, config_file: str | None, proc_root: str,
         output: str | None) -> None:
    """Read once and print the metrics in the Prometheus text format."""
    _setup_logging(log_level)
    engines = _make_engine_watch(config_file, proc_root, demo)
    source = _make_source(nvidia_smi, timeout, demo, strict=True)
    scraper = Scraper(source, engines)
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
