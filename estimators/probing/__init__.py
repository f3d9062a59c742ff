"""Real steps in an isolated process: measured peak and time, and races."""
