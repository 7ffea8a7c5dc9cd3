"""The gptq recipe stage (registers method "gptq")."""
