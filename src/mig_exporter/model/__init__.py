"""The data every read ends in: the snapshot of one driver read (cards, devices,
processes), the readings beside it (engines, pods, owners, Slurm job map), and the MIG
placement rules that turn what a card reports into devices. Pure; imports only core."""
