"""From a trace to seconds: the roofline per op and the collectives' cost."""
