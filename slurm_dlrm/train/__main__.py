from slurm_dlrm.commands.train import train

train.main(prog_name="python -m slurm_dlrm.train")
