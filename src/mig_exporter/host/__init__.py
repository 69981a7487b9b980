"""The host's own files, read safely: /proc (processes, PID namespace), each process's
cgroup, passwd, and what they say about who owns a GPU process (Slurm jobs, systemd units,
users, the Slurm job-map directory)."""
