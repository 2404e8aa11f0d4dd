"""medseg.datasets: synthetic dataset makers, DICOM series I/O, Decathlon datalists, validation."""
