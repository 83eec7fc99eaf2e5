"""sagellm on Ray: replays as Ray tasks (:class:`.executor.RayTasks`)."""
