from slurm_dlrm.cli import main

main()
