"""Test helpers shared by the test folders (one name style: helpers.<what>)."""
