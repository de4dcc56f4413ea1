"""Scale-out studies: the prefix router against Serve's default and one replica
(scale_bench), on engine replicas that log their load (load_log), the router's bound checked
against those logs (load_balance), and docs/scale-out.png (scale_out_plot)."""
