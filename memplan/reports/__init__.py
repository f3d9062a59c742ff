"""What memplan shows: the estimate's table, the run report (``OUT/report.html``, drawn in
inline SVG), the memory-timeline picture and snapshot, and the matplotlib figures."""
