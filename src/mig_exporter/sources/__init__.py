"""The GPU read paths, one module each: the protocol they share (`base`), nvidia-smi
(run as a command with a deadline), NVML (through one gateway to pynvml; card health in
`nvml_health`), the bundled demo,
and `auto` (NVML where it loads, else nvidia-smi). `xid` is the one reading not made at scrape
time: NVML's XID events, waited for in a thread of its own."""
