"""The demo: the built-in checkpoints and their training, and the run that shows the star on one machine. The daemons never import it."""
