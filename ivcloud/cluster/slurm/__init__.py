"""Slurm on the emulated cluster (`cluster up --scheduler slurm`,
`cluster srun|sbatch`): munge and slurmctld in the head node, slurmd in
every instance, a region of each job's own on every server it uses.
See docs/cluster.md, "Slurm".

Modules: conf (slurm.conf, topology.conf, task prolog, hook scripts:
text only), guests and guest_regions (slurmd in QEMU guests, a job's
device hot-plugged into them), nodes (what Slurm needs of each instance
kind), daemons (starting them during `up`, status), client (srun,
sbatch, sinfo, scontrol in the head node), hooks (PrologSlurmctld and
EpilogSlurmctld: the job's regions).
"""
