"""Where Q-Filters come from: query capture and observation during generation,
offline calibration from post-RoPE queries, and the filter file format."""
