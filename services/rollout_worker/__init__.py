"""rollout-worker: runs agents against env workers and an inference engine; publishes EpisodeResults."""
