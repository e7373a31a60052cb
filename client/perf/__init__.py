"""perf_analyzer input data for the diffulex model, the sweep behind `make perf`, and its report."""
