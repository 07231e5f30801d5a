package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// forward listens inside a network namespace and forwards each connection to an address in
// the namespace this process was started in. The local node (hack/node/node.sh) runs containerd and
// kubelet in their own namespace; this is how kubelet (127.0.0.1:P there) and Pods (the
// `kubernetes` Service IP, DNATed to the node address) reach the API server on the host's
// loopback, without an address, route or firewall rule on the host side.
func forward(args []string) int {
	fs := flag.NewFlagSet("forward", flag.ContinueOnError)
	netns := fs.String("netns", "", "network namespace to listen in (a path such as /run/netns/N)")
	listen := fs.String("listen", "", "comma-separated host:port addresses to listen on inside --netns")
	to := fs.String("to", "", "host:port to dial in this process's own network namespace")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *netns == "" || *listen == "" || *to == "" {
		fmt.Fprintln(os.Stderr, "usage: kharness forward --netns /run/netns/N --listen ADDR[,ADDR...] --to HOST:PORT")
		return 2
	}
	var listeners []net.Listener
	for _, addr := range strings.Split(*listen, ",") {
		l, err := listenIn(*netns, addr)
		if err != nil {
			logger.Printf("forward: listen %s in %s: %v", addr, *netns, err)
			return 1
		}
		listeners = append(listeners, l)
	}
	logger.Printf("forward: %s (in %s) -> %s", *listen, *netns, *to)
	errs := make(chan error, len(listeners))
	for _, l := range listeners {
		go func(l net.Listener) {
			for {
				c, err := l.Accept()
				if err != nil {
					errs <- err
					return
				}
				go pipe(c, *to)
			}
		}(l)
	}
	logger.Printf("forward: %v", <-errs)
	return 1
}

// listenIn opens a listening socket in the namespace at path. A socket keeps the namespace it
// was created in, so only this locked thread switches; it is never unlocked, and Go ends a
// thread whose goroutine exits locked, so no other goroutine ever runs in the node's namespace.
func listenIn(path, addr string) (net.Listener, error) {
	type result struct {
		l   net.Listener
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			ch <- result{err: err}
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			ch <- result{err: fmt.Errorf("setns: %w", err)}
			return
		}
		l, err := net.Listen("tcp", addr)
		ch <- result{l, err}
	}()
	r := <-ch
	return r.l, r.err
}

func pipe(in net.Conn, to string) {
	defer in.Close()
	out, err := net.Dial("tcp", to)
	if err != nil {
		logger.Printf("forward: dial %s: %v", to, err)
		return
	}
	defer out.Close()
	done := make(chan struct{}, 2)
	go func() { io.Copy(out, in); out.(*net.TCPConn).CloseWrite(); done <- struct{}{} }()
	go func() { io.Copy(in, out); in.(*net.TCPConn).CloseWrite(); done <- struct{}{} }()
	<-done
	<-done
}
