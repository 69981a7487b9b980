"""``python -m mig_exporter`` is the ``mig-exporter`` command."""

from mig_exporter.cli import main

if __name__ == "__main__":
    main()
