"""The GPU read paths, one module each: the protocol they share (`base`), nvidia-smi
(run as a command with a deadline), NVML (through one gateway to pynvml), the bundled demo,
and `auto` (NVML where it loads, else nvidia-smi)."""
