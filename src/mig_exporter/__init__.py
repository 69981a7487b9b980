"""mig-exporter: NVIDIA GPU memory per card, per MIG instance and per process, for Prometheus.

Data flows one way: a source reads the driver (``source_smi``, ``source_demo``),
pure parsers turn its output into a frozen ``Snapshot`` (``smi_xml``, ``smi_list``,
``placement``), the collector maps the snapshot to metric families
(``collector``), and ``server`` serves them over HTTP. Beside the driver, the same
read takes /proc (``procfs``), finds the inference engines (``engines``) and
attributes GPU memory to them (``attribution``). ``probe`` answers
``/probe?target=NAME`` by reading through a command named in the config file
(``config``).
"""

__version__ = "0.1.0"
