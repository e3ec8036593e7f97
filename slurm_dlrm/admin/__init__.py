"""Admin side: render the Slurm configuration from the site file and check it against a live cluster."""
