"""Worker benches: the TTFT scheduler against FCFS, and the compute clock (CostModel fitted to
the real numpy model) the scheduling benches share."""
