"""From a trace to seconds: the roofline per op, the CPU's measured rates, the probes'
calibration and the collectives' cost."""
