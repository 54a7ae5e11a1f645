"""What runs once per node beside the trainers: the uploader and peer daemons, their client, the registry."""
