package mqtttest

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"
)

// TestAdminIsWhatDynsecInitMakes runs `mosquitto_ctrl dynsec init`, as
// docs/mosquitto.md, section 2, has the operator make the server's account,
// and compares what it writes with what StartMosquitto writes for its
// admin: the admin role's ACLs and the plugin's default access, which the
// server changes as it connects. Tests must run against the broker users
// run. Before, the helper's admin role granted only $CONTROL/dynamic-
// security/#, not the reading of # and $SYS/# init grants, and its default
// access already refused publishClientReceive, so no test saw a server
// that had not set it yet (bug 449).
func TestAdminIsWhatDynsecInitMakes(t *testing.T) {
	ctrl := findBinary("mosquitto_ctrl")
	if ctrl == "" {
		t.Fatal("mqtttest: mosquitto_ctrl not installed: run make deps (it installs Debian's mosquitto)")
	}
	type file struct {
		Roles            []dynsecRole    `json:"roles"`
		DefaultACLAccess map[string]bool `json:"defaultACLAccess"`
	}
	read := func(path string) file {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var f file
		if err := json.Unmarshal(b, &f); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		return f
	}
	dir := t.TempDir()
	initPath := filepath.Join(dir, "init.json")
	if out, err := exec.Command(ctrl, "dynsec", "init", initPath, "companion-server", "secret").CombinedOutput(); err != nil {
		t.Fatalf("mosquitto_ctrl dynsec init: %v\n%s", err, out)
	}
	real := read(initPath)
	if len(real.Roles) != 1 {
		t.Fatalf("mosquitto_ctrl dynsec init wrote %d roles; want 1, its admin's", len(real.Roles))
	}

	m := &Mosquitto{dynsecPath: filepath.Join(dir, "helper.json"), adminPass: "secret"}
	if err := m.writeDynsec(); err != nil {
		t.Fatal(err)
	}
	helper := read(m.dynsecPath)
	var admin *dynsecRole
	for i, r := range helper.Roles {
		if r.Name == real.Roles[0].Name {
			admin = &helper.Roles[i]
		}
	}
	if admin == nil {
		t.Fatalf("the helper's roles %+v have none named %q, the role init gives its admin", helper.Roles, real.Roles[0].Name)
	}
	if !reflect.DeepEqual(admin.ACLs, real.Roles[0].ACLs) {
		t.Errorf("the helper's admin role grants\n%+v\nmosquitto_ctrl dynsec init's\n%+v", admin.ACLs, real.Roles[0].ACLs)
	}
	if !reflect.DeepEqual(helper.DefaultACLAccess, real.DefaultACLAccess) {
		t.Errorf("the helper's defaultACLAccess is %v; mosquitto_ctrl dynsec init's %v", helper.DefaultACLAccess, real.DefaultACLAccess)
	}
}
