"""What a run needs of its process: stop signals, CPU threads, the garbage collector, models kept between runs,
the failures that end a run in one line, and the checks made before torch is imported."""
