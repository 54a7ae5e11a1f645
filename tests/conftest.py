import os
import sys

# Test programs and helpers import from here and from src/ without installation.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))

# The module-scoped ``s3`` fixture (moto's and rclone's S3 servers) for every test module that takes it.
pytest_plugins = ["s3server"]
