"""Ray cluster configurations for running a swarm on many machines.

aws-spot.yaml and gcp-preemptible.yaml: Ray cluster launcher configs (`ray up`), GPU workers on spot/preemptible
machines, each worker running a peer daemon; kuberay-raycluster.yaml: the same as a KubeRay RayCluster;
local.py: several Ray nodes on this machine (127.0.0.1), for trying a multi-node swarm and for tests.
"""
