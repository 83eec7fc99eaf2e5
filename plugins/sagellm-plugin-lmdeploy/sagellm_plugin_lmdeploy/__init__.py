"""sagellm inside LMDeploy (see README.md). Importing this package does not import LMDeploy."""
