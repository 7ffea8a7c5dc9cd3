"""The awq recipe stage (registers method "awq")."""
