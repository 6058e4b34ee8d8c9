"""Code generated from proto/swarm.proto by proto/generate.py. Never edit by hand: change the .proto and regenerate."""
