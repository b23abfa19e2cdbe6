"""Worker side: the Ray actor and everything on its device."""
