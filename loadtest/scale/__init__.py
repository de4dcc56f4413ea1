"""Scale-out: prefix workloads against the prefix router, Serve's default router and one
replica, how evenly replicas were loaded, and the results page's scale-out plot; and two
tenants sharing one server (fair shares, priorities: tenants_bench)."""
