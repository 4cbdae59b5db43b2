"""Ray lifecycle, and nothing else: connecting, placement groups, and the group
of stage workers (create, wait, poll, replace one, shut down). Failure and
scaling policies live here too."""
