package main

import (
	"os"
	"syscall"
	"unsafe"
)

// fileIsTerminal asks the terminal driver for f's settings: only a terminal
// has them (/dev/null, also a character device, has not).
func fileIsTerminal(f *os.File) bool {
	var t syscall.Termios
	_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), syscall.TCGETS, uintptr(unsafe.Pointer(&t)))
	return errno == 0
}
