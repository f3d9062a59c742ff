"""The hardware: the GPUs memplan knows (their memory, peak rates and links) and the local one."""
