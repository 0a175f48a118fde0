"""Slurm on the emulated cluster (`cluster up --scheduler slurm`,
`cluster srun|sbatch`): munge and slurmctld in the head node, slurmd in
every instance, a region of each job's own on every server it uses.
See docs/cluster.md, "Slurm"; docs/ARCHITECTURE.md maps its modules.
"""
