"""The smoothquant recipe stage (registers method "smoothquant")."""
