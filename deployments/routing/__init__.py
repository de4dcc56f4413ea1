"""Which engine replica a request goes to and how many there are: the prefix-affinity
router and its policy, each replica's reported load, and the autoscaling policy on it."""
