//go:build linux

package bluez

// Addresses is how many addresses the Connector holds a device id for.
func (c *Connector) Addresses() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.ids)
}
