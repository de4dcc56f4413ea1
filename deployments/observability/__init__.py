"""What an operator watches: rayinfer's metrics (Ray's metrics API, the /metrics route)
and replica logs through Serve's logger."""
