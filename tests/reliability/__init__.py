"""Reliability and security suite of the pull path (issue 7): faults, load, hostile input."""
