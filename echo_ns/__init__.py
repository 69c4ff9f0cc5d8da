"""Echo swarm: RL post-training with rollouts from a volunteer peer-to-peer swarm."""

__version__ = "0.1.0"
