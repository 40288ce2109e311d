// Empty stand-in: tests/simt/simt.h defines what CUDA code uses from device_launch_parameters.h.
#pragma once
